"""Reward feedback learning (trainer/rl/reward_fl.py): the trainer's run of the engine's
last ODE steps gives the engine's image, the reward's gradient raises the reward, the KL
holds the model back, and samples it cannot continue are refused."""

from __future__ import annotations

import pytest
import torch

from rollwire.diffusion.digits import DigitsSpec, build_digits_model
from rollwire.diffusion.sampling import SamplingSettings
from rollwire.diffusion.trajectories import latent_trajectory, scoring_tensor
from rollwire.rollout.server.diffusion_engine import DiffusionEngine, ImageRequest
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory, decode_trajectory, encode
from rollwire.trainer.learner import Learner
from rollwire.trainer.models.flow_denoiser import FlowDenoiser
from rollwire.trainer.rl.flow_grpo import FlowGRPOStep
from rollwire.trainer.rl.latents import latent_batch
from rollwire.trainer.rl.reward_fl import RewardFLStep

ODE = SamplingSettings(steps=6, eta=0.0, sde_window=(4, 6))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits") / "model"
    return build_digits_model(folder, DigitsSpec(steps=2, batch_size=8), progress=False)


async def sampled(model_path, settings: SamplingSettings, count: int = 6) -> list[Trajectory]:
    engine = DiffusionEngine(model_path)
    await engine.start()
    try:
        requests = [ImageRequest(f"r{i}", "any", seed=i) for i in range(count)]
        generations = await engine.generate_images(requests, settings)
    finally:
        await engine.close()
    return [
        decode_trajectory(
            encode(
                latent_trajectory(
                    generation,
                    trajectory_id=f"t{i}",
                    group_id=f"g{i}",
                    sample_index=0,
                    prompt_ordinal=i,
                    task_id="any",
                    source="digits",
                    domain="brightness",
                    settings=settings,
                    reward=float((generation.image.mean() + 1) / 2),
                    scoring=scoring_tensor("", {}),
                )
            )
        )
        for i, generation in enumerate(generations)
    ]


def reward_fl_step(model_path, kl_coef: float) -> RewardFLStep:
    config = TrainerConfig(optimizer={"learning_rate": 3e-3}, algorithm={"kl": {"coef": kl_coef}})
    learner = Learner(model_path, config, family=FlowDenoiser())
    return RewardFLStep(learner, config, RLSection(group_size=1, max_steps=6))


async def test_the_trainer_continues_the_engines_samples_and_climbs_the_reward(
    model_path,
) -> None:
    trajectories = await sampled(model_path, ODE)
    step = reward_fl_step(model_path, 1e-4)
    first = step.step(trajectories)
    # The same two steps from the same latent in fp32: the engine's image, and the
    # differentiable brightness of it is what the reward-server paid.
    assert first["mismatch_abs_max"] <= 1e-5, first
    assert first["fl_reward"] == pytest.approx(first["reward_mean"], abs=1e-5)
    assert first["kl"] == 0.0 and first["recorded_steps"] == 2.0
    for _ in range(5):
        last = step.step(trajectories)
    # Brighter images from the same latents (0.45 -> 0.63 when written), and away from
    # the engine's, which the weights that drew them no longer make.
    assert last["fl_reward"] > first["fl_reward"] + 0.1, (first, last)
    assert "mismatch_abs_max" not in last
    images, _ = step.run_window(latent_batch(trajectories, 10))
    engine = torch.stack([torch.from_numpy(t.tensors["latents"][-1]) for t in trajectories])
    assert float((images.detach() - engine).abs().max()) > 1e-3
    # A KL coefficient 100 times larger keeps the velocities far nearer the start's.
    held = reward_fl_step(model_path, 1e-2)
    for _ in range(6):
        held_last = held.step(trajectories)
    assert held_last["kl"] < last["kl"] / 5, (held_last["kl"], last["kl"])


async def test_samples_it_cannot_continue_are_refused_with_the_reason(model_path) -> None:
    sde = await sampled(model_path, SamplingSettings(steps=6, eta=0.7, sde_window=(3, 5)), 2)
    ode = await sampled(model_path, ODE, 2)
    reward_fl = reward_fl_step(model_path, 0.0)
    learner, config = reward_fl.learner, reward_fl.config
    with pytest.raises(ValueError, match="drawn by the SDE"):
        reward_fl.step(sde)
    middle = await sampled(model_path, SamplingSettings(steps=6, eta=0.0, sde_window=(2, 4)), 2)
    with pytest.raises(ValueError, match="last steps recorded"):
        reward_fl.step(middle)
    del ode[0].tensors["scoring"]
    with pytest.raises(ValueError, match="no `scoring` tensor"):
        reward_fl.step(ode)
    flow_grpo = FlowGRPOStep(learner, config, RLSection(group_size=2, max_steps=1))
    with pytest.raises(ValueError, match="drawn by the ODE"):
        flow_grpo.step(await sampled(model_path, ODE, 2))
