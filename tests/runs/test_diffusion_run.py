"""`rollwire train -c examples/diffusion_flow_grpo.yaml` through every real process, on a
barely trained digits model: latent trajectories from the diffusion rollout-server,
scored by the reward-server's judge, through the buffer to Flow-GRPO's step, weights
back to the engine, and the evaluation's quality measures and pictures on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollwire.diffusion.digits import MARKER, DigitsSpec, build_digits_model
from tests.helpers.runs import assert_no_process_left, jsonl, rollwire_train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "diffusion_flow_grpo.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A barely trained digits model both runs start from (the rollout-server and the
    trainer read it; neither writes into it)."""
    folder = tmp_path_factory.mktemp("digits") / "model"
    return build_digits_model(folder, DigitsSpec(steps=2, batch_size=8), progress=False)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_diffusion_run_goes_through_every_process(tmp_path, model) -> None:
    run_dir, result = rollwire_train(
        tmp_path,
        f"rollout_server.model_path={model}",
        "rl.max_steps=3",
        "orchestrator.eval_every=2",
        "trainer.checkpointing.every=1",
        "orchestrator.eval_dataset.size=24",
        "orchestrator.images.grid_images=16",
        "orchestrator.images.steps=4",
        "orchestrator.images.sde_window=[1, 3]",
        "orchestrator.images.eval_steps=4",
        config=EXAMPLE,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sample quality at version 3: Frechet distance" in result.stdout
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["recorded_steps"] == 2 and s["sequences"] == 32 for s in steps)
    assert max(s["staleness_max"] for s in steps) <= 1
    trained = [s for s in steps if s["optimizer_steps"] > 0]
    assert trained and all(math.isfinite(s["loss"]) and s["kl"] >= 0 for s in trained)
    # Where the engine sampled with the weights being trained, the trainer's
    # log-probabilities of its steps are the engine's (float32 on both sides).
    mismatches = [s["mismatch_abs_max"] for s in steps if "mismatch_abs_max" in s]
    assert mismatches and max(mismatches) <= 1e-5, mismatches

    rollout_log = [
        json.loads(line)
        for line in (run_dir / "logs" / "rollout-server.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert [e["version"] for e in rollout_log if e["msg"] == "weights updated"] == [1, 2, 3]

    evals = jsonl(run_dir / "metrics" / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, 2, 3]
    for entry in evals:
        assert entry["tasks"] == 24 and 0.0 <= entry["eval_reward"] <= 1.0
        assert 0.0 <= entry["judged_share"] <= 1.0
        assert entry["frechet"] > 0 and entry["diversity"] > 0
    assert evals[0]["frechet_ratio"] == 1.0 and evals[0]["diversity_ratio"] == 1.0
    pictures = sorted(p.name for p in (run_dir / "metrics" / "images").iterdir())
    assert pictures == ["version_000000.png", "version_000002.png", "version_000003.png"]
    assert (run_dir / "metrics" / "image_quality.png").stat().st_size > 1000

    # The checkpoint is a diffusers folder, with the scheduler and the task file beside it.
    from diffusers import UNet2DModel

    checkpoint = run_dir / "checkpoints" / "step_000003"
    assert (checkpoint / "scheduler").is_dir() and (checkpoint / MARKER).exists()
    assert UNet2DModel.from_pretrained(checkpoint).config.sample_size == 8
    assert_no_process_left(run_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_reward_feedback_learning_goes_through_every_process(tmp_path, model) -> None:
    """`examples/diffusion_reward_fl.yaml`: ODE samples whose last steps the trainer runs
    again with the reward's gradient; the engine's image is the trainer's, and the
    early stop's result names a kept evaluation."""
    run_dir, result = rollwire_train(
        tmp_path,
        f"rollout_server.model_path={model}",
        "rl.max_steps=2",
        "rl.groups_per_step=2",
        "orchestrator.eval_every=1",
        "trainer.checkpointing.every=1",
        "orchestrator.eval_dataset.size=24",
        "orchestrator.images.grid_images=0",
        "orchestrator.images.steps=4",
        "orchestrator.images.eval_steps=4",
        "reward_fl.grad_steps=2",
        config=EXAMPLE.with_name("diffusion_reward_fl.yaml"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["recorded_steps"] == 2 and s["sequences"] == 16 for s in steps)
    # The trainer's run of the engine's last two ODE steps, with the weights that took
    # them, ends on the engine's image; its differentiable reward is what was paid.
    first = steps[0]
    assert first["mismatch_abs_max"] <= 1e-5, first
    assert first["fl_reward"] == pytest.approx(first["reward_mean"], abs=1e-4)
    assert all(math.isfinite(s["loss"]) and s["kl"] >= 0 for s in steps)
    quality = json.loads((run_dir / "metrics" / "quality_band.json").read_text())
    assert quality["band"] == 0.2 and quality["kept"]["policy_version"] in (0, 1, 2)
    assert "sample quality band 0.2" in result.stdout or "stopped early" in result.stdout
    assert_no_process_left(run_dir)
