"""Flow-GRPO (trainer/rl/flow_grpo.py): the loss by hand on known ratios, and the
engine's recorded steps recomputed by the trainer to within 1e-5, through the wire."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollwire.diffusion.digits import DigitsSpec, build_digits_model
from rollwire.diffusion.sampling import SamplingSettings
from rollwire.diffusion.trajectories import latent_trajectory
from rollwire.rollout.server.diffusion_engine import DiffusionEngine, ImageRequest
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory, decode_trajectory, encode
from rollwire.trainer.learner import Learner
from rollwire.trainer.models.flow_denoiser import FlowDenoiser
from rollwire.trainer.rl.flow_grpo import FlowGRPOStep
from rollwire.trainer.rl.latents import latent_batch

SDE = SamplingSettings(steps=6, eta=0.8, sde_window=(1, 5))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits") / "model"
    return build_digits_model(folder, DigitsSpec(steps=2, batch_size=8), progress=False)


def trajectory(index: int, generation, reward: float) -> Trajectory:
    return latent_trajectory(
        generation,
        trajectory_id=f"t{index}",
        group_id=f"g{index // 2}",
        sample_index=index % 2,
        prompt_ordinal=index // 2,
        task_id="any",
        source="digits",
        domain="digit",
        settings=SDE,
        reward=reward,
    )


async def sampled(model_path, rewards: list[float]) -> list[Trajectory]:
    engine = DiffusionEngine(model_path)
    await engine.start()
    try:
        requests = [ImageRequest(f"r{i}", "any", seed=i) for i in range(len(rewards))]
        generations = await engine.generate_images(requests, SDE)
    finally:
        await engine.close()
    # Through the wire, as the buffer serves them.
    return [
        decode_trajectory(encode(trajectory(i, g, r)))
        for i, (g, r) in enumerate(zip(generations, rewards, strict=True))
    ]


async def test_the_trainer_recomputes_the_engines_steps_and_the_update_moves_the_policy(
    model_path,
) -> None:
    trajectories = await sampled(model_path, [1.0, 0.0, 0.3, 0.6])
    config = TrainerConfig(optimizer={"learning_rate": 1e-3}, algorithm={"kl": {"coef": 0.1}})
    learner = Learner(model_path, config, family=FlowDenoiser())
    step = FlowGRPOStep(learner, config, RLSection(group_size=2, max_steps=2))
    first = step.step(trajectories)
    # float32 on both sides: the largest difference of a recorded step's log-probability.
    assert first["mismatch_abs_max"] <= 1e-5, first
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["kl"] == 0.0
    second = step.step(trajectories)
    # The weights moved: the samples are one version old, their log-probabilities no
    # longer the trainer's (and no longer a measure of engine-trainer mismatch).
    assert abs(second["behaviour_kl"]) > 1e-5 and second["kl"] > 0
    assert "mismatch_abs_max" not in second and second["staleness_mean"] == 1.0


async def test_with_lora_the_kl_reference_is_the_model_with_its_adapters_off(model_path) -> None:
    trajectories = await sampled(model_path, [1.0, 0.0])
    lora = {"rank": 2, "alpha": 4, "target_modules": ["conv1", "conv2"]}
    config = TrainerConfig(
        optimizer={"learning_rate": 1e-2}, algorithm={"kl": {"coef": 0.1}}, lora=lora
    )
    learner = Learner(model_path, config, family=FlowDenoiser())
    step = FlowGRPOStep(learner, config, RLSection(group_size=2, max_steps=2))
    assert step.step(trajectories)["kl"] == 0.0  # adapters start at zero: the base model
    assert step.step(trajectories)["kl"] > 0


async def test_the_clipped_surrogate_by_hand(model_path) -> None:
    """A group of two, rewards 1 and 0: GRPO's advantages are +1 and -1. With recorded
    log-probabilities set below and above the trainer's by ln 1.5 and ln 0.5, every
    step's ratio is 1.5 (A = +1) or 0.5 (A = -1); PPO's clip [0.8, 1.28] makes the
    surrogate 1.28 and -0.8, the loss per step -1.28 and +0.8, their mean -0.24, and
    half the steps are clipped high and half low."""
    trajectories = await sampled(model_path, [1.0, 0.0])
    # Plain PPO: the ratio against the recorded log-probabilities (no correction).
    config = TrainerConfig(algorithm={"correction": {"type": "none"}})
    learner = Learner(model_path, config, family=FlowDenoiser())
    step = FlowGRPOStep(learner, config, RLSection(group_size=2, max_steps=1))
    batch = latent_batch(trajectories, 10)
    with torch.no_grad():
        now = step.logprobs(batch, step.step_distributions(batch))
    for trajectory, shift in zip(trajectories, (math.log(1.5), math.log(0.5)), strict=True):
        row = int(trajectory.sample_index)
        trajectory.behaviour_logprobs = (now[row] - shift).numpy().astype(np.float32)
    metrics = step.step(trajectories)
    assert metrics["loss"] == pytest.approx(-0.24, abs=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # (1.5 + 0.5) / 2
    assert (metrics["clip_frac_high"], metrics["clip_frac_low"]) == (0.5, 0.5)


def test_only_latent_batches_of_one_setting_are_taken() -> None:
    tokens = Trajectory(
        trajectory_id="t",
        group_id="g",
        task_id="x",
        sample_index=0,
        prompt_ordinal=0,
        source="s",
        domain="d",
        token_ids=np.zeros(1, np.int32),
        loss_mask=np.ones(1, np.uint8),
        behaviour_logprobs=np.zeros(1, np.float32),
        policy_versions=np.zeros(1, np.int64),
        reward=0.0,
    )
    with pytest.raises(ValueError, match="not 'tokens'"):
        latent_batch([tokens], 10)
    tokens.kind = "latents"
    with pytest.raises(ValueError, match="tensors"):
        latent_batch([tokens], 10)
    with pytest.raises(ValueError, match=r"3 latents \(steps \+ 1 expected\)"):
        latent_trajectory(
            SimpleNamespace(
                recorded_steps=[1, 2, 3],
                logprobs=[0.0] * 3,
                policy_versions=[0] * 3,
                latents=np.zeros((3, 1, 8, 8)),
                label=3,
            ),
            trajectory_id="t",
            group_id="g",
            sample_index=0,
            prompt_ordinal=0,
            task_id="3",
            source="s",
            domain="digit",
            reward=0.0,
            settings=SDE,
        )
