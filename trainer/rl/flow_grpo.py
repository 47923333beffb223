"""Flow-GRPO's step: policy-gradient RL for a flow-matching denoiser on latent trajectories.

Each recorded SDE step of a sample is one action of a Gaussian policy
(`rollwire.diffusion.flow`), so a latent trajectory (`rollwire.diffusion.trajectories`)
is read as a token one: one "token" per recorded step with its log-probability under
the weights that sampled it and the version that took it, and in `tensors` the latents,
the label and the sampling settings. The step then is the RL table's:
- advantages: `trainer.algorithm.advantage` (a group estimator; `grpo` is Flow-GRPO's),
  one per sample, broadcast over its recorded steps;
- loss: `trainer.algorithm.loss` (`ppo_clip` is Flow-GRPO's) per step, on the ratio of the
  step's log-probability now to the recorded one, aggregated by `trainer.algorithm.aggregation`;
- KL to the model the run started from (`trainer.algorithm.kl.coef`): between two
  Gaussians of one std it is exact, ||mean - mean_ref||^2 / (2 std^2) per step.
The first pass, before any update, also measures how far the trainer's log-probabilities
are from the engine's for the same transitions (`mismatch_abs_max`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollwire.diffusion.sampling import SamplingSettings, logprobs_of, step_distributions
from rollwire.diffusion.trajectories import SAMPLING_KEYS
from rollwire.services.core.config.algorithms import settings_of
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.learner import Learner
from rollwire.trainer.math.algorithms import ADVANTAGE_ESTIMATORS
from rollwire.trainer.math.losses import POLICY_LOSSES, aggregate
from rollwire.trainer.models.flow_denoiser import Noised


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
    )


class FlowGRPOStep:
    """See the module docstring. `group_size`: samples per prompt, adjacent in a batch."""

    def __init__(self, learner: Learner, group_size: int, any_label: int = 10) -> None:
        self.learner = learner
        self.config = learner.config
        self.group_size = group_size
        self.any_label = any_label
        self._reference: Any = None

    def _velocity(self, model: Any = None):
        def velocity(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.learner.forward(Noised(x, t, labels), model).float()

        return velocity

    def step_distributions(
        self, batch: LatentBatch, model: Any = None
    ) -> list[tuple[torch.Tensor, float]]:
        """For each recorded step, the (mean, std) of its Gaussian under `model` (the
        trained one by default), with gradients when they are on."""
        device = self.learner.device
        return step_distributions(
            self._velocity(model),
            batch.latents.to(device),
            batch.labels.to(device),
            batch.steps,
            batch.settings,
        )

    def logprobs(self, batch: LatentBatch, distributions: list) -> torch.Tensor:
        """[B, R] log-probabilities of the recorded transitions under `distributions`."""
        return logprobs_of(batch.latents.to(self.learner.device), distributions)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        settings = self.config.algorithm.advantage
        if settings.type not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"Flow-GRPO takes a group estimator ({sorted(ADVANTAGE_ESTIMATORS)}), not "
                f"trainer.algorithm.advantage.type {settings.type!r}"
            )
        return ADVANTAGE_ESTIMATORS[settings.type](
            rewards=rewards, group_size=self.group_size, **settings_of(settings)
        )

    def step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One optimizer update on a batch of whole groups; its metrics."""
        batch = latent_batch(trajectories, self.any_label)
        device = self.learner.device
        advantages = self.advantages(batch.rewards).to(device)
        old = batch.behaviour_logprobs.to(device)
        mask = torch.ones_like(old)
        self.learner.model.train()
        distributions = self.step_distributions(batch)
        logprobs = self.logprobs(batch, distributions)
        loss_settings = self.config.algorithm.loss
        token_loss = POLICY_LOSSES[loss_settings.type](
            logprobs=logprobs,
            old_logprobs=old,
            advantages=advantages[:, None].expand_as(old),
            mask=mask,
            **settings_of(loss_settings),
        )
        numerator, denominator = aggregate(
            token_loss.values, mask, self.config.algorithm.aggregation
        )
        loss = numerator / max(denominator, 1.0)
        metrics = {
            "loss": float(loss.detach()),
            "reward": float(batch.rewards.mean()),
            "ratio_mean": float(token_loss.ratio.mean()),
            "clip_high_fraction": _fraction(token_loss.clipped_high),
            "clip_low_fraction": _fraction(token_loss.clipped_low),
            "mismatch_abs_max": float((logprobs.detach() - old).abs().max()),
        }
        coef = self.config.algorithm.kl.coef
        if coef > 0:
            kl = self.kl(batch, distributions)
            loss = loss + coef * kl
            metrics["kl"] = float(kl.detach())
        self.learner.backend.backward(loss)
        metrics.update(self.learner.optimizer_update())
        return metrics

    def kl(self, batch: LatentBatch, distributions: list) -> torch.Tensor:
        """The mean over samples and steps of KL(step policy || the starting model's)."""
        if self._reference is None:
            self._reference = self.learner.frozen_reference()
        with torch.no_grad():
            reference = self.step_distributions(batch, self._reference)
        terms = [
            ((mean - ref_mean.float()) ** 2).flatten(1).sum(dim=1) / (2 * std * std)
            for (mean, std), (ref_mean, _) in zip(distributions, reference, strict=True)
        ]
        return torch.stack(terms, dim=1).mean()


def _fraction(flags: torch.Tensor) -> float:
    """The share of True in `flags`; 0 for a loss that flags nothing (an empty tensor)."""
    return float(flags.float().mean()) if flags.numel() else 0.0
