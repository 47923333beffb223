"""Latent trajectories as the diffusion steps read them: stacked into one batch.

`latent_batch(trajectories, any_label)` stacks a batch's latent trajectories
(`rollwire.diffusion.trajectories`; all drawn with the same sampling settings and
recorded steps) into a `LatentBatch` (`any_label_of` in the flow denoiser's family is a
model folder's unconditional label, `rank_share` in `batching` one rank's part of a
minibatch); `batch_metrics` is what a step reports
of its batch. Flow-GRPO (`flow_grpo.py`) and reward feedback learning (`reward_fl.py`)
are both a `LatentStep`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollwire.diffusion.sampling import SamplingSettings, Velocity
from rollwire.diffusion.trajectories import SAMPLING_KEYS, scoring_of
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.learner import Learner
from rollwire.trainer.models.flow_denoiser import Noised, any_label_of
from rollwire.trainer.rl.update import average


@dataclass
class LatentBatch:
    """Latent trajectories stacked for one step (all sampled with the same settings)."""

    latents: torch.Tensor
    """[B, R + 1, C, H, W]"""
    labels: torch.Tensor
    """[B]"""
    steps: list[int]
    """The R recorded step indices (the same for every sample)."""
    behaviour_logprobs: torch.Tensor
    """[B, R] as the engine recorded them."""
    rewards: torch.Tensor
    """[B]"""
    settings: SamplingSettings
    versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))
    """[B, R] the policy version that took each recorded step."""
    domains: list[str] = field(default_factory=list)
    """[B] each sample's reward domain."""
    scoring: list[tuple[str, dict[str, Any]] | None] = field(default_factory=list)
    """[B] each sample's (reference, metadata), None for one without a `scoring` tensor."""

    def select(self, rows: list[int]) -> LatentBatch:
        """The batch of `rows` only."""
        index = torch.tensor(rows)
        return dataclasses.replace(
            self,
            latents=self.latents[index],
            labels=self.labels[index],
            behaviour_logprobs=self.behaviour_logprobs[index],
            rewards=self.rewards[index],
            versions=self.versions[index],
            domains=[self.domains[row] for row in rows],
            scoring=[self.scoring[row] for row in rows],
        )


def latent_batch(trajectories: list[Trajectory], any_label: int) -> LatentBatch:
    """Stacks latent trajectories; ValueError for another kind, or mixed settings or steps."""
    if not trajectories:
        raise ValueError("no trajectories")
    first = trajectories[0]
    for trajectory in trajectories:
        if trajectory.kind != "latents":
            raise ValueError(f"Flow-GRPO trains latent trajectories, not {trajectory.kind!r} ones")
        missing = {"latents", "label", "sampling"} - set(trajectory.tensors)
        if missing:
            raise ValueError(f"trajectory {trajectory.trajectory_id}: no {sorted(missing)} tensors")
        if not np.array_equal(trajectory.tensors["sampling"], first.tensors["sampling"]) or (
            not np.array_equal(trajectory.token_ids, first.token_ids)
        ):
            raise ValueError("a batch's latent trajectories must share sampling settings and steps")
    steps, eta, shift, guidance = (
        float(v) for v in first.tensors["sampling"][: len(SAMPLING_KEYS)]
    )
    recorded = [int(step) for step in first.token_ids]
    settings = SamplingSettings(
        steps=int(steps),
        eta=eta,
        sde_window=(min(recorded), max(recorded) + 1) if recorded else (0, 0),
        shift=shift,
        guidance=guidance,
        any_label=any_label,
    )
    return LatentBatch(
        latents=torch.from_numpy(np.stack([t.tensors["latents"] for t in trajectories])),
        labels=torch.from_numpy(np.concatenate([t.tensors["label"] for t in trajectories])),
        steps=recorded,
        behaviour_logprobs=torch.from_numpy(np.stack([t.behaviour_logprobs for t in trajectories])),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        settings=settings,
        versions=torch.from_numpy(
            np.stack([np.asarray(t.policy_versions, np.int64) for t in trajectories])
        ),
        domains=[t.domain for t in trajectories],
        scoring=[
            scoring_of(t.tensors["scoring"]) if "scoring" in t.tensors else None
            for t in trajectories
        ],
    )


def batch_metrics(batch: LatentBatch, trainer_version: int) -> dict[str, float]:
    """What a diffusion step reports of its batch before training on it: the rewards,
    the samples and recorded steps, how stale the steps are."""
    versions = batch.versions.numpy()
    metrics = {
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(batch.rewards.std(unbiased=False)),
        "sequences": float(len(batch.rewards)),
        "recorded_steps": float(len(batch.steps)),
    }
    if versions.size:
        metrics["staleness_mean"] = float(trainer_version - versions.mean())
        metrics["staleness_max"] = float(trainer_version - versions.min())
    return metrics


class LatentStep:
    """What Flow-GRPO's and reward feedback learning's steps share: built on a learner,
    it attaches itself under `name` (its `@collective train_step` runs on every rank),
    sets the schedule's length, freezes the starting model as the KL's reference when
    `trainer.algorithm.kl.coef` > 0, and keeps each update's metrics of the last step."""

    name = ""
    """The name the step attaches under."""

    def __init__(self, learner: Learner, config: TrainerConfig, rl: RLSection) -> None:
        self.learner, self.config, self.rl = learner, config, rl
        self.any_label = any_label_of(learner.model_path)
        learner.total_updates = rl.max_steps * self.updates_per_step
        self.kl_coef = config.algorithm.kl.coef
        self._reference: Any = learner.frozen_reference() if self.kl_coef > 0 else None
        self.update_metrics: list[dict[str, float]] = []
        """The metrics of each optimizer update of the last step, in order."""
        learner.attach(self, self.name)

    @property
    def updates_per_step(self) -> int:
        batching = self.config.batching
        return batching.minibatches_per_step * batching.epochs_per_step

    def velocity(self, model: Any = None) -> Velocity:
        """The denoiser's velocity under `model` (the trained one by default), in float32."""

        def velocity(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.learner.forward(Noised(x, t, labels), model).float()

        return velocity

    def finish(self, metrics: dict[str, float], started: float) -> dict[str, float]:
        """The step's metrics with its updates' averaged in, their count and the step's
        seconds; on a sharded backend, rank 0 gathers the new weights to publish."""
        metrics.update(average(self.update_metrics))
        metrics["optimizer_steps"] = float(len(self.update_metrics))
        metrics["step_seconds"] = time.perf_counter() - started
        if self.learner.sharded:
            self.learner.gather()
        return metrics

    def step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """`train_step` outside a run (benchmarks, tests): the version is the updates so far."""
        return self.train_step(trajectories, self.learner.optimizer_steps)

    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        raise NotImplementedError
