"""Reward feedback learning: a differentiable reward's gradient pushed back through the
last denoising steps of a flow-matching denoiser, with a KL to the starting model.

The rollout-server samples each image by the ODE and records the latent before each of
its last K steps (`reward_fl.grad_steps`; a latent trajectory with `eta` 0,
`rollwire.diffusion.trajectories`). The trainer picks each sample up at the first of
those latents and runs the K steps again with the weights it trains and gradients on;
the image they end in is scored by the differentiable twin of the sample's domain
(`rollwire.diffusion.differentiable`: for `digit`, the judge's probability of the wanted
digit, what the reward-server pays). The loss of a sample is

    -reward(image) + trainer.algorithm.kl.coef * mean over the K steps of
                     1/2 ||v(x_k) - v_ref(x_k)||^2

where `v_ref` is the starting model's velocity at the same latent: the KL between the two
models' steps under unit noise, up to each step's scale (what keeps the samples near the
model the run began with). The first K - 1 steps' latents depend on the weights, so the
gradient runs through the whole chain, as in DRaFT-K; the steps before the window were
taken by the engine with weights at most `rl.max_staleness` versions old.

The step's first update, before the weights move, also compares the trainer's image with the
engine's for the samples whose every recorded step the trained weights took
(`mismatch_abs_max`, the largest pixel difference: the two run the same steps in fp32).
A step makes `batching.epochs_per_step` x `batching.minibatches_per_step` updates; no
group statistics are needed, so any `rl.group_size` works.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from rollwire.diffusion.differentiable import DifferentiableReward, differentiable_reward
from rollwire.diffusion.flow import ode_step, time_grid
from rollwire.diffusion.sampling import guided
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import rank_share, split_rows
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.rl.latents import (
    LatentBatch,
    LatentStep,
    batch_metrics,
    latent_batch,
)


class RewardFLStep(LatentStep):
    """See the module docstring. Build one on the learner (it attaches itself):
    `train_step` is what the trainer loop calls."""

    name = "reward_fl"

    def __init__(self, learner: Learner, config: TrainerConfig, rl: RLSection) -> None:
        super().__init__(learner, config, rl)
        self._rewards: dict[str, DifferentiableReward] = {}

    def reward_of(self, domain: str) -> DifferentiableReward:
        if domain not in self._rewards:
            self._rewards[domain] = differentiable_reward(domain)
        return self._rewards[domain]

    def run_window(self, batch: LatentBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The recorded steps run again from the window's first latent with the trained
        weights (gradients on when they are): the final images [B, C, H, W] and, with a
        KL coefficient, the mean over steps of 1/2 ||v - v_ref||^2 per sample [B]."""
        device = self.learner.device
        grid = time_grid(batch.settings.steps, batch.settings.shift)
        labels = batch.labels.to(device)
        x = batch.latents[:, 0].to(device)
        guidance = batch.settings.guidance
        field = guided(self.velocity(), guidance, self.any_label)
        reference = (
            None
            if self._reference is None
            else guided(self.velocity(self._reference), guidance, self.any_label)
        )
        gaps = []
        for index in batch.steps:
            t, t_next = grid[index], grid[index + 1]
            times = torch.full((len(x),), t, device=device, dtype=x.dtype)
            v = field(x, times, labels)
            if reference is not None:
                with torch.no_grad():
                    v_ref = reference(x, times, labels)
                gaps.append(0.5 * (v - v_ref).pow(2).flatten(1).sum(dim=1))
            x = ode_step(x, v, t, t_next)
        return x, (torch.stack(gaps, dim=1).mean(dim=1) if gaps else None)

    def rewards(self, batch: LatentBatch, images: torch.Tensor) -> torch.Tensor:
        """[B] each image's differentiable reward in its sample's domain."""
        out = images.new_zeros(len(images))
        for domain in sorted(set(batch.domains)):
            rows = [i for i, d in enumerate(batch.domains) if d == domain]
            scoring = [batch.scoring[i] for i in rows]
            if any(entry is None for entry in scoring):
                raise ValueError(
                    "reward feedback learning scores its own images: these latent "
                    "trajectories carry no `scoring` tensor (task reference and metadata)"
                )
            index = torch.tensor(rows, device=images.device)
            references = [entry[0] for entry in scoring]  # type: ignore[index]
            metadata = [entry[1] for entry in scoring]  # type: ignore[index]
            out = out.index_put(
                (index,), self.reward_of(domain)(images[index], references, metadata)
            )
        return out

    @collective
    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        """One trainer step (`batching.epochs_per_step` x `batching.minibatches_per_step`
        optimizer updates on minibatches of samples); returns metrics, the update ones
        averaged."""
        started = time.perf_counter()
        whole = latent_batch(trajectories, self.any_label)
        check_window(whole)
        metrics = batch_metrics(whole, trainer_version)
        current = torch.from_numpy((whole.versions.numpy() == trainer_version).all(axis=1))
        self.update_metrics = []
        minibatches = split_rows(len(trajectories), self.config.batching.minibatches_per_step)
        for epoch in range(self.config.batching.epochs_per_step):
            for number, rows in enumerate(minibatches):
                first = epoch == 0 and number == 0  # the weights have not moved yet
                self.update_metrics.append(
                    self._update(whole, rows, current if first else None, metrics)
                )
        return self.finish(metrics, started)

    def _update(
        self,
        whole: LatentBatch,
        rows: list[int],
        current: torch.Tensor | None,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        """One optimizer update on `rows` of `whole`. With `current` (the step's first
        update, before the weights move), the largest difference of the images from the
        engine's on the `current` samples goes into `metrics`. On
        several ranks each computes its share of the rows (`rank_share`; one without
        rows runs a pass that counts for nothing, as the passes are collective) and the
        loss is scaled so the averaged gradient is the minibatch's."""
        learner = self.learner
        backend = learner.backend
        ranks = backend.world_size
        mine = rank_share(rows, backend.rank, ranks)
        taken = mine or rows[:1]
        batch = whole if len(taken) == len(whole.rewards) else whole.select(taken)
        weight = torch.full((len(taken),), 1.0 if mine else 0.0, device=learner.device)
        backend.zero_grad()
        learner.model.train()
        images, gaps = self.run_window(batch)
        reward = self.rewards(batch, images) * weight
        scale = ranks / len(rows)
        loss = -reward.sum() * scale
        out = {"fl_reward": float(reward.detach().sum()) / len(rows)}
        if gaps is not None:
            gaps = gaps * weight
            loss = loss + self.kl_coef * gaps.sum() * scale
            out["kl"] = float(gaps.detach().sum()) / len(rows)
        out["loss"] = float(loss.detach()) / ranks
        if current is not None:
            engine = batch.latents[:, -1].to(images.device)
            seen = current[torch.tensor(taken)].to(images.device) & weight.bool()
            gap = (images.detach() - engine).abs().flatten(1).amax(dim=1)
            worst = float(gap[seen].max()) if bool(seen.any()) else -1.0
            if ranks > 1:
                worst = backend.reduce_metrics({"mismatch": worst}, "max")["mismatch"]
            if worst >= 0:
                metrics["mismatch_abs_max"] = worst
        backend.backward(loss)
        if ranks > 1:  # each rank holds its share: the minibatch's are their sums
            out = backend.reduce_metrics(out, "sum")
        out.update(learner.optimizer_update())
        return out


def check_window(batch: LatentBatch) -> None:
    """ValueError unless `batch` is what reward feedback learning continues: ODE samples
    whose recorded steps are consecutive and end at the last step."""
    settings = batch.settings
    if settings.eta != 0:
        raise ValueError(
            "reward feedback learning runs the ODE's last steps again: these samples were "
            f"drawn by the SDE (eta {settings.eta}); is this a Flow-GRPO run's buffer?"
        )
    steps = batch.steps
    if (
        not steps
        or steps[-1] != settings.steps - 1
        or any(b - a != 1 for a, b in itertools.pairwise(steps))
    ):
        raise ValueError(
            f"reward feedback learning needs the last steps recorded, in order; these samples "
            f"recorded steps {steps} of {settings.steps}"
        )
    if not np.isfinite(batch.latents.numpy()).all():
        raise ValueError("a latent trajectory holds values that are not finite")
