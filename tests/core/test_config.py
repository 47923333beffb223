"""Config: defaults, YAML, environment and --set precedence, error paths, resolved output."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rollwire.services.core.config import (
    ConfigError,
    RunConfig,
    TrainerConfig,
    load_config,
    parse_assignment,
    schema,
    write_resolved_config,
)


def test_defaults_validate_and_every_field_has_help() -> None:
    config = load_config(environ={})
    assert config.env_server.server.port == 0
    assert config.env_server.server.host == "127.0.0.1"

    def walk(model: type) -> list[str]:
        missing = []
        for name, info in model.model_fields.items():
            if not info.description:
                missing.append(f"{model.__name__}.{name}")
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, RunConfig.__mro__[1]):
                missing += walk(annotation)
        return missing

    assert walk(RunConfig) == []


def test_precedence_file_then_environment_then_set(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("env_server:\n  max_sessions: 10\n  session_idle_seconds: 5\nrun:\n  seed: 1\n")
    environ = {
        "ROLLWIRE__ENV_SERVER__MAX_SESSIONS": "20",
        "ROLLWIRE__RUN__SEED": "2",
        "UNRELATED": "x",
    }
    config = load_config(path, ["env_server.max_sessions=30"], environ=environ)
    assert config.env_server.max_sessions == 30  # --set wins
    assert config.run.seed == 2  # environment beats the file
    assert config.env_server.session_idle_seconds == 5.0  # file beats defaults


def test_values_are_parsed_as_yaml() -> None:
    config = load_config(
        overrides=[
            "reward_server.item_timeout_seconds=1e-1",
            "env_server.envs=[a, b]",
            "endpoints.env_servers=[]",
        ],
        environ={},
    )
    assert config.reward_server.item_timeout_seconds == pytest.approx(0.1)
    assert config.env_server.envs == ["a", "b"]


def test_unknown_key_is_named_by_path(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("env_server:\n  server:\n    prot: 5\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert "env_server.server.prot: unknown key" in str(caught.value)
    assert str(path) in str(caught.value)


def test_every_error_is_listed_with_its_path() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            overrides=["trainer.backend=nccl", "env_server.max_sessions=0", "nope=1"], environ={}
        )
    message = str(caught.value)
    assert "trainer.backend:" in message
    assert "env_server.max_sessions:" in message
    assert "nope: unknown key" in message


def test_unknown_environment_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"env_server.max_sesions: unknown key"):
        load_config(environ={"ROLLWIRE__ENV_SERVER__MAX_SESIONS": "3"})


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1", "a.=1"])
def test_malformed_assignment(bad: str) -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_assignment(bad)


def test_override_through_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="run.seed holds a value"):
        load_config(overrides=["run.seed=1", "run.seed.x=1"], environ={})


def test_bad_yaml_and_non_mapping(tmp_path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken, environ={})
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(listing, environ={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="cert_file and key_file must be given together"):
        load_config(overrides=["client.tls.cert_file=/x.pem"], environ={})
    with pytest.raises(ConfigError, match="either token or token_file"):
        load_config(overrides=["client.auth.token=a", "client.auth.token_file=/t"], environ={})


def test_token_file_is_read(tmp_path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    config = load_config(overrides=[f"client.auth.token_file={secret}"], environ={})
    assert config.client.auth.resolve_token() == "s3cret"


def test_resolved_config_round_trips_and_masks_secrets(tmp_path) -> None:
    config = load_config(overrides=["run.seed=7", "client.auth.token=hunter2"], environ={})
    written = write_resolved_config(config, tmp_path / "run")
    text = written.read_text()
    assert "hunter2" not in text
    data = yaml.safe_load(text)
    assert data["run"]["seed"] == 7
    data["client"]["auth"]["token"] = None
    assert RunConfig.model_validate(data).run.seed == 7


def test_config_modules_import_neither_torch_nor_grpc() -> None:
    import subprocess

    code = (
        "import sys, rollwire.services.core.config as c; c.load_config(environ={}); "
        "print(sorted(m for m in ('torch', 'grpc', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_overriding_one_key_keeps_the_sections_other_defaults() -> None:
    config = load_config(overrides=["orchestrator.eval_dataset.kwargs={min_terms: 2}"], environ={})
    # The evaluation dataset's own defaults (its seed and size) survive.
    assert (
        config.orchestrator.eval_dataset.seed == 10_000
        and config.orchestrator.eval_dataset.size == 200
    )
    assert config.orchestrator.eval_dataset.kwargs == {"min_terms": 2}


def test_switching_a_pluggable_part_drops_the_old_kinds_settings(tmp_path) -> None:
    switched = load_config(
        overrides=["orchestrator.dataset.type=file", "orchestrator.dataset.path=/data.jsonl"],
        environ={},
    )
    assert (
        switched.orchestrator.dataset.type == "file"
        and str(switched.orchestrator.dataset.path) == "/data.jsonl"
    )
    path = tmp_path / "run.yaml"
    path.write_text("orchestrator:\n  dataset:\n    type: file\n    path: /d.parquet\n")
    assert load_config(path, environ={}).orchestrator.dataset.domain == "math"


@pytest.mark.parametrize(
    "example", sorted(str(p) for p in (Path(__file__).parents[2] / "examples").glob("*.yaml"))
)
def test_examples_are_valid_configs(example: str) -> None:
    load_config(example, environ={})


def test_the_default_example_is_the_default() -> None:
    example = load_config(Path(__file__).parents[2] / "examples" / "default.yaml", environ={})
    assert example == load_config(environ={})


def test_every_model_is_importable_from_the_package_and_from_models() -> None:
    import rollwire.services.core.config as package
    from rollwire.services.core.config import models, orchestrator, runtime, servers

    for module in (runtime, servers, orchestrator, models):
        defined = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        }
        assert defined <= set(models.__all__), defined - set(models.__all__)
    for name in models.__all__:
        assert getattr(package, name) is getattr(models, name), name


def test_the_overlong_penalty_counts_to_the_orchestrators_limit() -> None:
    config = RunConfig.model_validate(
        {"trainer": {"overlong": {"penalty_tokens": 4}}, "orchestrator": {"max_new_tokens": 12}}
    )
    assert config.trainer.algorithm.overlong.max_tokens == 12
    assert RunConfig().trainer.algorithm.overlong.max_tokens is None  # the default is left alone
    with pytest.raises(ValueError, match="more than orchestrator.max_new_tokens=10"):
        RunConfig.model_validate({"trainer": {"overlong": {"penalty_tokens": 40}}})


def test_a_flat_trainer_section_of_earlier_releases_loads_where_each_key_lives_now(
    tmp_path, caplog, monkeypatch
) -> None:
    from rollwire.services.core.config import trainer as trainer_section

    # Each moved key is warned about once per process: whatever this worker loaded
    # before (another test's flat section) must not decide what this one sees.
    monkeypatch.setattr(trainer_section, "_warned", set())
    old = tmp_path / "old.yaml"
    old.write_text(
        "trainer:\n  learning_rate: 0.003\n  checkpoint_every: 0\n  weight_transport: group\n"
        "  advantage: {type: rloo}\n  lr_schedule: {type: cosine}\n"
    )
    with caplog.at_level("WARNING"):
        config = load_config(old, ["trainer.micro_batch_size=4"], environ={})
    trainer = config.trainer
    assert trainer.optimizer.learning_rate == 0.003 and trainer.checkpointing.every == 0
    assert trainer.weights.transport == "group" and trainer.algorithm.advantage.type == "rloo"
    assert trainer.schedule.type == "cosine" and trainer.batching.micro_batch_size == 4
    assert "trainer.learning_rate is now trainer.optimizer.learning_rate" in caplog.text
    # The written config has the new keys only: it loads again without a word.
    resolved = write_resolved_config(config, tmp_path / "run")
    assert "learning_rate: 0.003" in resolved.read_text()
    assert load_config(resolved, environ={}).trainer == trainer
    both = tmp_path / "both.yaml"
    both.write_text("trainer:\n  learning_rate: 0.1\n  optimizer: {learning_rate: 0.2}\n")
    with pytest.raises(ConfigError, match="keep trainer.optimizer.learning_rate"):
        load_config(both, environ={})
    with pytest.raises(ValueError, match="keep trainer.checkpointing.every"):
        TrainerConfig(checkpoint_every=1, checkpointing={"every": 2})


def test_a_pipeline_reads_its_held_out_rows_from_eval_data_or_a_fraction_not_both() -> None:
    for section in ("sft", "dpo", "reward_model"):
        config = load_config(None, [f"{section}.eval_data=held.jsonl"], environ={})
        assert str(getattr(config, section).eval_data) == "held.jsonl"
        with pytest.raises(ConfigError, match="both say where the held-out"):
            load_config(
                None,
                [f"{section}.eval_data=held.jsonl", f"{section}.held_out_fraction=0.2"],
                environ={},
            )


# ---------------------------------------------------------------- errors that say what to do


def _choice_fields(
    model: type, path: str, prefix: tuple[str, ...] = (), member: bool = False
) -> Iterator[tuple[str, tuple[str, ...], str, list[str]]]:
    """(path, the assignments that reach it, "union" or "literal", its choices) for every
    union on `type` and every literal field under `model`, through the members of unions."""
    for name, field in model.model_fields.items():
        here = f"{path}.{name}" if path else name
        annotation = schema.strip(field.annotation)
        tags = schema.tags(field.annotation)
        if tags:
            yield here, prefix, "union", tags
            for member in schema.members(field.annotation):
                tag = schema.tag(member)
                chosen = (*prefix, f"{here}.type={tag}")
                yield from _choice_fields(schema.strip(member), here, chosen, True)
            continue
        choices = schema.choices(field.annotation)
        if choices and not (member and name == "type"):  # a member's tag: the union's
            yield here, prefix, "literal", [choice.strip("'") for choice in choices]
        child = schema.model_of(annotation)
        if child is not None:
            yield from _choice_fields(child, here, prefix)


def test_every_choice_field_names_its_choices_and_the_value_given() -> None:
    """Every union on `type` and every literal field of the config, given a wrong value,
    fails with a line that names the field as a user writes it, the value given, and every
    accepted choice."""
    fields = list(_choice_fields(RunConfig, ""))
    assert len([f for f in fields if f[2] == "union"]) >= 5, fields
    assert len([f for f in fields if f[2] == "literal"]) >= 30, fields
    for path, reach, _kind, choices in fields:
        value = "no_such_choice"
        if path in {"telemetry.trackers", "image_inputs.formats"}:  # lists of literals
            value = f"[{value}]"
        with pytest.raises(ConfigError) as caught:
            load_config(overrides=[*reach, f"{path}={value}"], environ={})
        line = next(
            (line for line in str(caught.value).splitlines()[1:] if "no_such_choice" in line),
            None,
        )
        assert line is not None, (path, str(caught.value))
        assert line.strip().startswith(path), (path, line)
        for choice in choices:
            assert choice in line, (path, choice, line)


def test_a_bare_type_name_is_short_for_its_section() -> None:
    """`--set trainer.algorithm.advantage=rloo` is `...advantage.type=rloo`; a value that is
    neither a section nor a name says both forms."""
    config = load_config(overrides=["trainer.algorithm.advantage=rloo"], environ={})
    assert config.trainer.algorithm.advantage.type == "rloo"
    config = load_config(overrides=["orchestrator.dataset=digits"], environ={})
    assert config.orchestrator.dataset.type == "digits"
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["trainer.algorithm.loss=3"], environ={})
    message = str(caught.value)
    assert (
        "trainer.algorithm.loss: expected a section with a `type`, or a type's name; got 3"
        in message
    )
    assert "`--set trainer.algorithm.loss=ppo_clip` is short for" in message


def test_an_unknown_key_names_the_closest_known_one_and_the_path_a_user_writes() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            overrides=[
                "runtime.seed=1",
                "trainer.algorithm.advantage={type: on_policy_distill, kl_coeff: 2}",
                "trainer.optimizer.max_grad=1",
                "run.seed=abc",
            ],
            environ={},
        )
    message = str(caught.value)
    assert "  runtime: unknown key; did you mean 'run'? (the sections: " in message
    # pydantic's path holds the tag (advantage.on_policy_distill.kl_coeff): not what one writes
    assert "  trainer.algorithm.advantage.kl_coeff: unknown key; did you mean 'kl_coef'?" in message
    assert "  trainer.optimizer.max_grad: unknown key; did you mean 'max_grad_norm'?" in message
    assert "  run.seed: should be a valid integer" in message and "(given: 'abc')" in message


def test_the_configuration_reference_has_every_key_with_its_help() -> None:
    """`rollwire config --reference` (the site's reference page) is written from the models:
    every key of every section, the types of every union among them, with its help."""
    from rollwire.services.core.config.reference import markdown

    text = markdown()
    rows = {
        line.split(" | ")[0].strip("| `") for line in text.splitlines() if line.startswith("| `")
    }

    def keys(model: type) -> Iterator[str]:
        for name, field in model.model_fields.items():
            yield name
            for member in [field.annotation, *schema.members(field.annotation)]:
                inner = schema.model_of(member)
                if inner is not None:
                    yield from keys(inner)

    sections = set(RunConfig.model_fields)  # headings, not rows
    assert all(f"## `{section}`" in text for section in sections)
    missing = sorted(set(keys(RunConfig)) - rows - sections)
    assert missing == [], missing
    assert "| `learning_rate` | float, > 0 | `0.0001` | AdamW learning rate" in text
    assert "\n#### `trainer.algorithm.advantage`\n" in text
    assert "`trainer.algorithm.advantage` — `type: rloo`" in text
