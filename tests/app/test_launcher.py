"""Which model a run starts from (the launcher's `prepare_model`)."""

from __future__ import annotations

import json

import pytest

from rollwire.services.app.launcher import LaunchError, prepare_model
from rollwire.services.core.config import RunConfig


def config(**sections) -> RunConfig:
    return RunConfig.model_validate(sections)


def test_trainer_model_path_is_the_runs_model(tiny_model_path, capsys) -> None:
    path = prepare_model(config(trainer={"model_path": str(tiny_model_path)}))
    assert path == tiny_model_path
    assert "warm-up skipped" in capsys.readouterr().out


def test_either_model_path_names_the_same_model(tiny_model_path) -> None:
    both = {"model_path": str(tiny_model_path)}
    assert prepare_model(config(rollout_server=both, trainer=both)) == tiny_model_path
    assert prepare_model(config(rollout_server=both), progress=False) == tiny_model_path


def test_two_different_models_are_a_clear_error(tiny_model_path, tmp_path) -> None:
    with pytest.raises(LaunchError, match="name different models"):
        prepare_model(
            config(
                rollout_server={"model_path": str(tiny_model_path)},
                trainer={"model_path": str(tmp_path)},
            )
        )


def test_a_folder_that_is_no_model_is_named(tmp_path) -> None:
    with pytest.raises(LaunchError, match=r"trainer.model_path .* \(no config.json\)"):
        prepare_model(config(trainer={"model_path": str(tmp_path)}))


def test_trainer_settings_that_do_not_compose_are_refused_with_the_reason() -> None:
    """Ranks need a multi-process backend; LoRA and a KL reference run on `local` only; a
    constant aggregation needs its constant: errors, not settings silently ignored."""
    from pydantic import ValidationError

    from rollwire.services.core.config import TrainerConfig

    cases = {
        "needs trainer.backend fsdp2 or deepspeed": {"world_size": 2},
        "trainer.lora runs on trainer.backend=local only": {"backend": "fsdp2", "lora": {}},
        "trainer.algorithm.kl.coef > 0": {"backend": "deepspeed", "kl": {"coef": 0.1}},
        "needs trainer.algorithm.aggregation_constant": {"aggregation": "constant"},
    }
    for message, settings in cases.items():
        with pytest.raises(ValidationError, match=message):
            TrainerConfig(**settings)
    assert TrainerConfig(backend="fsdp2", world_size=2).distributed.timeout_seconds == 600


def test_the_built_in_models_context_is_checked_against_the_episode_cap() -> None:
    env = {"dataset": {"type": "env", "env_id": "guess_the_number"}, "eval_dataset": None}
    with pytest.raises(LaunchError, match=r"max_episode_tokens is 512 .* is 256 tokens"):
        prepare_model(config(orchestrator=env))
    with pytest.raises(LaunchError, match=r"max_new_tokens is 300 .* is 256 tokens"):
        prepare_model(config(orchestrator={"max_new_tokens": 300}))


def test_env_servers_come_from_one_place() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set one of them"):
        config(endpoints={"env_servers": ["127.0.0.1:1"]}, run={"local_env_servers": 2})
    assert config(endpoints={"env_servers": ["127.0.0.1:1"]}).run.local_env_servers is None


def test_the_warm_up_of_an_env_served_elsewhere_is_skipped_with_the_reason(
    tmp_path, monkeypatch, capsys
) -> None:
    """An external env (any language, not registered here) must not stop the run."""
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(tmp_path))
    run = config(
        orchestrator={
            "dataset": {"type": "env", "env_id": "an_env_in_ruby"},
            "eval_dataset": None,
            "agent": {"max_episode_tokens": 200},
        },
        endpoints={"env_servers": ["127.0.0.1:1"]},
        run={"tiny_model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}},
    )
    model = prepare_model(run)
    assert model.name.startswith("tiny-")  # the untrained model, not a warm one
    assert (
        "warm-up skipped: no scripted demonstrator for env 'an_env_in_ruby'"
        in capsys.readouterr().out
    )


def test_an_image_dataset_and_the_diffusion_engine_come_together() -> None:
    """The diffusion engine samples only images, and only it samples them: a run that
    sets one without the other is refused when its config is read, with both settings
    named; an image run gets held-out seeds of the same prompts when it names none."""
    from pydantic import ValidationError

    from rollwire.services.core.config import RunConfig

    for settings in (
        {"rollout_server": {"engine": "diffusion"}},
        {"orchestrator": {"dataset": {"type": "images"}}},
    ):
        with pytest.raises(ValidationError, match="rollout_server.engine: diffusion"):
            RunConfig.model_validate(settings)
    images = RunConfig.model_validate(
        {"rollout_server": {"engine": "diffusion"}, "orchestrator": {"dataset": {"type": "images"}}}
    )
    held_out = images.orchestrator.eval_dataset
    assert (held_out.type, held_out.prompts, held_out.seed) == ("images", ["any"], 1 << 40)
    sharded = RunConfig.model_validate(
        {
            **images.model_dump(mode="json", include={"rollout_server", "orchestrator"}),
            "trainer": {"world_size": 2, "backend": "fsdp2"},
        }
    )
    assert sharded.trainer.backend == "fsdp2"  # the flow denoiser trains on every backend


def test_reward_feedback_learning_is_chosen_and_checked_when_the_config_is_read() -> None:
    """`reward_fl.enabled` picks reward feedback learning's pipeline for an image run; the
    settings it does not use, a domain without a differentiable twin, or a gradient
    window longer than the sampling are refused, each named."""
    from pydantic import ValidationError

    from rollwire.diffusion.differentiable import DIFFERENTIABLE
    from rollwire.services.core.config import DIFFERENTIABLE_DOMAINS, RunConfig
    from rollwire.trainer.pipelines.table import pipeline_of

    assert set(DIFFERENTIABLE_DOMAINS) == set(DIFFERENTIABLE)
    image_run = {
        "rollout_server": {"engine": "diffusion"},
        "orchestrator": {"dataset": {"type": "images"}},
    }
    assert pipeline_of(RunConfig.model_validate(image_run)).name == "flow_grpo"
    enabled = {**image_run, "reward_fl": {"enabled": True, "grad_steps": 3}}
    assert pipeline_of(RunConfig.model_validate(enabled)).name == "reward_fl"
    refused = {
        "rollout_server.engine: diffusion": {"reward_fl": {"enabled": True}},
        "enabled is false": {**image_run, "reward_fl": {"grad_steps": 3}},
        "images.eta is Flow-GRPO's": {
            **enabled,
            "orchestrator": {"dataset": {"type": "images"}, "images": {"eta": 0.5}},
        },
        "cannot exceed": {**enabled, "reward_fl": {"enabled": True, "grad_steps": 11}},
        "pay: correct has no gradient": {
            **enabled,
            "orchestrator": {"dataset": {"type": "images", "metadata": {"pay": "correct"}}},
        },
    }
    for message, settings in refused.items():
        with pytest.raises(ValidationError, match=message):
            RunConfig.model_validate(settings)


def test_early_stopping_on_sample_quality_keeps_the_last_evaluation_inside_the_band(
    tmp_path,
) -> None:
    """orchestrator.images.quality_band: rollwire train stops once `quality_patience`
    evaluations in a row leave the band, and names the last one inside with its
    checkpoint (metrics/quality_band.json and the summary)."""
    from rollwire.services.app.run import _quality_left_the_band, summarise
    from rollwire.services.core.config import RunConfig

    config = RunConfig.model_validate(
        {
            "rollout_server": {"engine": "diffusion"},
            "trainer": {"checkpointing": {"every": 5}},
            "orchestrator": {
                "dataset": {"type": "images"},
                "eval_every": 10,
                "images": {"quality_band": 0.2, "quality_patience": 2},
            },
        }
    )
    (tmp_path / "metrics").mkdir()
    rows = [
        {"policy_version": 0, "eval_reward": 0.1, "frechet_ratio": 1.0, "diversity_ratio": 1.0},
        {"policy_version": 10, "eval_reward": 0.2, "frechet_ratio": 1.15, "diversity_ratio": 0.9},
        {"policy_version": 20, "eval_reward": 0.3, "frechet_ratio": 1.3, "diversity_ratio": 0.9},
        {"policy_version": 30, "eval_reward": 0.3, "frechet_ratio": 1.1, "diversity_ratio": 0.7},
    ]
    for row in rows:
        row.update(frechet=2.0 * row["frechet_ratio"], diversity=row["diversity_ratio"])
    said: list[str] = []
    # One evaluation outside is not yet `quality_patience` 2 of them.
    steps = [{"step": 10, "policy_version": 10}, {"step": 20, "policy_version": 20}]
    assert not _quality_left_the_band(config, tmp_path, rows[:3], steps, say=said.append)
    assert _quality_left_the_band(config, tmp_path, rows, steps, say=said.append)
    assert said == [
        "sample quality left the band at version 30 (Frechet x1.10, diversity x0.70; band "
        "0.2): stopping the run"
    ]
    result = json.loads((tmp_path / "metrics" / "quality_band.json").read_text())
    assert result["stopped_at"] == 30 and result["kept"]["policy_version"] == 10
    assert result["kept"]["checkpoint"] == str(tmp_path / "checkpoints" / "step_000010")
    (tmp_path / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        "stopped early at version 30: sample quality left the band (0.2); the last "
        "evaluation inside it: version 10, held-out reward 0.200, Frechet x1.15, diversity "
        f"x0.90 ({tmp_path / 'checkpoints' / 'step_000010'})"
    ) in summarise(tmp_path, 1.0)
    with pytest.raises(Exception, match="must divide orchestrator.eval_every"):
        RunConfig.model_validate(
            {
                **config.model_dump(mode="json", include={"rollout_server", "orchestrator"}),
                "trainer": {"checkpointing": {"every": 3}},
            }
        )


def test_a_member_restarted_at_another_address_replaces_its_old_one(tmp_path) -> None:
    """A rollout-server restarted on another Ray node serves at a new address: the members
    file the orchestrator and the trainer read follows it; the other member is untouched."""
    from rollwire.services.app.launcher import Service, Stack
    from rollwire.services.app.scaler import Scaler
    from rollwire.services.core.members import MEMBERS_FILE, read_members

    stack = Stack(tmp_path, tmp_path / "config.yaml", {})
    for index, address in enumerate(("10.0.0.1:7001", "10.0.0.2:7001")):
        name = f"rollout-server-{index}"
        ready = tmp_path / "logs" / f"{name}.ready"
        ready.write_text(address + "\n")
        stack.services.append(Service(name, None, tmp_path / f"{name}.log", ready, address=address))  # type: ignore[arg-type]
    endpoints = {"rollout_servers": ["10.0.0.1:7001", "10.0.0.2:7001"]}
    config = RunConfig.model_validate({"endpoints": endpoints})
    scaler = Scaler(stack, config, tmp_path)
    assert scaler.poll() == []
    (tmp_path / "logs" / "rollout-server-0.ready").write_text("10.0.0.3:7001\n")
    assert scaler.poll() == ["rollout-server-0 serves at 10.0.0.3:7001 now (was 10.0.0.1:7001)"]
    assert read_members(tmp_path / MEMBERS_FILE)["rollout-server"] == [
        "10.0.0.3:7001",
        "10.0.0.2:7001",
    ]
    assert stack.services[0].address == "10.0.0.3:7001"
    assert scaler.poll() == []


def test_a_ray_address_where_nothing_listens_is_refused_at_once() -> None:
    """Ray's own client retries such an address for minutes; the run stops in seconds."""
    import socket

    from rollwire.services.app.ray_cluster import check_reachable

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(
        LaunchError, match=f"no Ray cluster answers at run.ray.address 127.0.0.1:{port}"
    ):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(LaunchError, match="is not HOST:PORT"):
        check_reachable("head-node")
    check_reachable("auto")  # the cluster this machine is part of: Ray finds it


def test_trainer_nodes_must_divide_the_trainers_ranks() -> None:
    """Refused when the config is read, not when the cluster is asked for the ranks."""
    trainer = {"backend": "fsdp2", "world_size": 4}
    ray = {"address": "10.0.0.5:6379", "trainer_nodes": 3}
    with pytest.raises(
        ValueError, match="run.ray.trainer_nodes 3 does not divide trainer.world_size 4"
    ):
        RunConfig.model_validate({"trainer": trainer, "run": {"ray": ray}})
    ray["trainer_nodes"] = 2
    assert (
        RunConfig.model_validate({"trainer": trainer, "run": {"ray": ray}}).run.ray.trainer_nodes
        == 2
    )
