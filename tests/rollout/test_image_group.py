"""An image group end to end below the trainer: a diffusion rollout-server samples, the
reward-server's `digit` domain pays, and the latent trajectories the orchestrator makes
pass through a buffer whole and are what Flow-GRPO's step reads."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.diffusion.digits import DigitsSpec, build_digits_model
from rollwire.diffusion.sampling import SamplingSettings
from rollwire.reward.server import registrations
from rollwire.rollout.orchestrator.images import image_group
from rollwire.rollout.orchestrator.servers import Servers
from rollwire.rollout.server.diffusion_engine import DiffusionEngine
from rollwire.services.core.config import RewardServerConfig, RunConfig
from rollwire.services.core.datasets import Task
from rollwire.trainer.rl.latents import latent_batch
from tests.helpers.servers import Running, serve_engine

pytestmark = pytest.mark.integration


async def test_an_image_group_is_sampled_scored_and_carried_to_the_trainer(
    start_service, tmp_path
) -> None:
    model = build_digits_model(
        tmp_path / "model", DigitsSpec(steps=2, batch_size=8), progress=False
    )
    rollout_address, _ = await serve_engine(start_service, DiffusionEngine(model))
    (registration,) = registrations(RewardServerConfig(workers=1))
    reward = await start_service([registration])
    config = RunConfig.model_validate(
        {
            "endpoints": {"rollout_servers": [rollout_address], "reward_servers": [reward.address]},
            "client": {"connect_timeout_seconds": 20},
        }
    )
    servers = Servers(config, eos=0)
    buffer = Running(tmp_path / "buffer", group_size=4)
    try:
        await servers.wait_until_serving()
        settings = SamplingSettings(steps=5, eta=0.7, sde_window=(0, 4))
        task = Task(7, "digits-any-3", "any", "3", "digit", "digits")
        group = await image_group(servers, task, 7, settings, [100, 101, 102, 103])
        assert [t.trajectory_id for t in group] == ["7/0", "7/1", "7/2", "7/3"]
        assert all(0.0 <= t.reward <= 1.0 and t.kind == "latents" for t in group)
        assert all(t.reward_components["score_error"] == 0.0 for t in group)
        assert group[0].tensors["latents"].shape == (5, 1, 8, 8)
        assert group[0].token_ids.tolist() == [0, 1, 2, 3]
        answers = await buffer.producer.put_group(group)
        assert all(answer.accepted for answer in answers)
        batch = await asyncio.to_thread(buffer.trainer.get_batch, 0, 1, 2.0)
        assert batch.trajectories == group
        stacked = latent_batch(batch.trajectories, any_label=10)
        assert stacked.latents.shape == (4, 5, 1, 8, 8) and stacked.steps == [0, 1, 2, 3]
        assert stacked.labels.tolist() == [10] * 4 and stacked.settings.steps == 5
    finally:
        buffer.stop()
        await servers.close()
        await registration.servicer.close()
