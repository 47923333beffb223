"""Latent trajectories as the diffusion steps read them: stacked into one batch.

`latent_batch(trajectories, any_label)` stacks a batch's latent trajectories
(`rollwire.diffusion.trajectories`; all drawn with the same sampling settings and
recorded steps) into a `LatentBatch`; `any_label_of(folder)` is a model folder's
unconditional label; `rank_share(rows, rank, ranks)` is one rank's part of a
minibatch on a sharded backend (every rank runs the step on the same batch and takes
its own rows, so its passes stay collective). Flow-GRPO (`flow_grpo.py`) and reward feedback learning
(`reward_fl.py`) both start here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.diffusion.data import ANY
from rollwire.diffusion.sampling import SamplingSettings
from rollwire.diffusion.trajectories import SAMPLING_KEYS, scoring_of
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import split_rows
from rollwire.trainer.models.flow_denoiser import MARKER
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


def any_label_of(folder: Path) -> int:
    """The unconditional branch's label of a model folder (its task file), 10 without one."""
    marker = Path(folder) / MARKER
    if marker.exists():
        return int(json.loads(marker.read_text()).get("any_label", ANY))
    return ANY


def rank_share(rows: list[int], rank: int, ranks: int) -> list[int]:
    """The contiguous part of a minibatch's `rows` that `rank` of `ranks` computes
    (empty when there are fewer rows than ranks)."""
    if ranks <= 1:
        return list(rows)
    runs = split_rows(len(rows), ranks)
    return [rows[i] for i in runs[rank]] if rank < len(runs) else []


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


def finish_step(
    learner: Any, metrics: dict[str, float], updates: list[dict[str, float]], started: float
) -> dict[str, float]:
    """A diffusion step's metrics with its updates' averaged in, their count and the
    step's seconds; on a sharded backend, rank 0 gathers the new weights to publish."""
    metrics.update(average(updates))
    metrics["optimizer_steps"] = float(len(updates))
    metrics["step_seconds"] = time.perf_counter() - started
    if learner.sharded:
        learner.gather()
    return metrics
