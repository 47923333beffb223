"""Flow-GRPO's step: policy-gradient RL for a flow-matching denoiser on latent trajectories.

Each recorded SDE step of a sample is one action of a Gaussian policy
(`rollwire.diffusion.flow`), so a latent trajectory (`rollwire.diffusion.trajectories`)
is read as a token one: one "token" per recorded step with its log-probability under
the weights that sampled it and the version that took it, and in `tensors` the latents,
the label and the sampling settings. The step then is the RL table's:
- advantages: `trainer.algorithm.advantage` (a group estimator; `grpo` is Flow-GRPO's),
  one per sample, broadcast over its recorded steps;
- loss: `trainer.algorithm.loss` (`ppo_clip` is Flow-GRPO's) per step, on the ratio of the
  step's log-probability now to the proximal one, with the off-policy correction of
  `trainer.algorithm.correction` towards the recorded one (as for text: a sample taken
  by older weights is weighted, or masked, by how far they are), aggregated by
  `trainer.algorithm.aggregation`;
- KL to the model the run started from (`trainer.algorithm.kl.coef`): between two
  Gaussians of one std it is exact, ||mean - mean_ref||^2 / (2 std^2) per step.
The first pass, before any update, also measures how far the trainer's log-probabilities
are from the engine's for the same transitions (`mismatch_abs_max`). A step makes
`batching.epochs_per_step` x `batching.minibatches_per_step` updates, as the RL step does;
the batching's token settings (micro-batches by tokens) do not apply: a minibatch of
latents goes through in one pass.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rollwire.diffusion.sampling import logprobs_of, step_distributions
from rollwire.services.core.config.algorithms import settings_of
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import rank_share, split_rows
from rollwire.trainer.learner import collective
from rollwire.trainer.math.algorithms import ADVANTAGE_ESTIMATORS
from rollwire.trainer.math.losses import policy_objective
from rollwire.trainer.rl.latents import (
    LatentBatch,
    LatentStep,
    batch_metrics,
    latent_batch,
)


class FlowGRPOStep(LatentStep):
    """See the module docstring. Build one on the learner (it attaches itself, like
    `RLStep`): `train_step` is what the trainer loop calls. A batch holds whole groups of
    `rl.group_size` samples, adjacent."""

    name = "flow_grpo"

    def step_distributions(
        self, batch: LatentBatch, model: Any = None
    ) -> list[tuple[torch.Tensor, float]]:
        """For each recorded step, the (mean, std) of its Gaussian under `model` (the
        trained one by default), with gradients when they are on."""
        device = self.learner.device
        return step_distributions(
            self.velocity(model),
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
            rewards=rewards, group_size=self.rl.group_size, **settings_of(settings)
        )

    @collective
    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        """One trainer step on whole groups: `batching.epochs_per_step` x
        `batching.minibatches_per_step` optimizer updates (minibatches of samples), each
        against the proximal log-probabilities of the weights the step started from,
        corrected towards the engine's as `trainer.algorithm.correction` says; returns
        metrics, the update ones averaged."""
        started = time.perf_counter()
        learner = self.learner
        whole = latent_batch(trajectories, self.any_label)
        if whole.settings.eta <= 0:
            raise ValueError(
                "Flow-GRPO learns from SDE steps: these samples were drawn by the ODE (eta 0), "
                "whose steps have no log-probability"
            )
        advantages = self.advantages(whole.rewards)
        keep = [i for i in range(len(trajectories)) if float(advantages[i]) != 0.0]
        metrics = batch_metrics(whole, trainer_version)
        metrics["sequences_with_signal"] = float(len(keep))
        self.update_metrics = []
        if not keep:  # every group's rewards equal: nothing to learn from
            metrics.update(loss=0.0, grad_norm=0.0, optimizer_steps=0.0)
            metrics["learning_rate"] = learner.learning_rate()
            metrics["step_seconds"] = time.perf_counter() - started
            return metrics
        batch = whole.select(keep)
        advantages = advantages[keep].to(learner.device)
        behaviour = batch.behaviour_logprobs.to(learner.device)
        # The engine-trainer mismatch is read on the steps the weights being trained took.
        current = torch.from_numpy(
            np.stack([trajectories[i].policy_versions for i in keep]) == trainer_version
        ).to(learner.device)
        # One update: its own forward gives the proximal log-probabilities. More: the
        # weights move after the first, so they are taken before it.
        proximal = None
        if self.updates_per_step > 1:
            with torch.no_grad():
                proximal = self.logprobs(batch, self.step_distributions(batch))
            metrics.update(self._mismatch(proximal, behaviour, current))
        minibatches = split_rows(len(keep), self.config.batching.minibatches_per_step)
        for _ in range(self.config.batching.epochs_per_step):
            for rows in minibatches:
                self.update_metrics.append(
                    self._update(batch, rows, advantages, behaviour, proximal, current, metrics)
                )
        return self.finish(metrics, started)

    def _update(
        self,
        batch: LatentBatch,
        rows: list[int],
        advantages: torch.Tensor,
        behaviour: torch.Tensor,
        proximal: torch.Tensor | None,
        current: torch.Tensor,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        """One optimizer update on `rows` of `batch`; its metrics (`metrics` gets the
        engine-trainer mismatch on the `current` steps when this is the step's only
        update). On several ranks each computes its share of the rows (`rank_share`;
        one without rows runs a pass that counts for nothing, as the passes are
        collective) and the losses are scaled so the averaged gradient is the
        minibatch's."""
        learner, algorithm = self.learner, self.config.algorithm
        backend = learner.backend
        ranks = backend.world_size
        mine = rank_share(rows, backend.rank, ranks)
        taken = mine or rows[:1]
        part = batch if len(taken) == len(batch.rewards) else batch.select(taken)
        index = torch.tensor(taken, device=learner.device)
        backend.zero_grad()
        learner.model.train()
        distributions = self.step_distributions(part)
        logprobs = self.logprobs(part, distributions)
        old = behaviour[index]
        mask = torch.ones_like(old) if mine else torch.zeros_like(old)
        if proximal is None:
            seen = current[index] & mask.bool()
            metrics.update(self._mismatch(logprobs.detach(), old, seen, backend))
        objective = policy_objective(
            logprobs=logprobs,
            proximal_logprobs=logprobs.detach() if proximal is None else proximal[index],
            behaviour_logprobs=old,
            advantages=advantages[index],
            mask=mask,
            loss=algorithm.loss.type,
            loss_settings=settings_of(algorithm.loss),
            correction=algorithm.correction.type,
            correction_settings=settings_of(algorithm.correction),
            aggregation=algorithm.aggregation,
            constant=algorithm.aggregation_constant or 1.0,
        )
        total = objective.denominator
        if ranks > 1:
            total = backend.reduce_metrics({"denominator": total}, "sum")["denominator"]
        total = max(total, 1e-12)
        share = objective.denominator / total
        loss = objective.numerator * (ranks / total)
        out = {key: (value * share if mine else 0.0) for key, value in objective.metrics.items()}
        out["loss"] = float(objective.numerator.detach()) / total
        if algorithm.kl.coef > 0:
            kl = self.kl(part, distributions) * mask[:, 0]
            loss = loss + algorithm.kl.coef * kl.sum() * (ranks / len(rows))
            out["kl"] = float(kl.detach().sum()) / len(rows)
        backend.backward(loss)
        if ranks > 1:  # each rank holds its share: the minibatch's are their sums
            out = backend.reduce_metrics(out, "sum")
        out.update(learner.optimizer_update())
        return out

    @staticmethod
    def _mismatch(
        trainer: torch.Tensor, engine: torch.Tensor, current: torch.Tensor, backend: Any = None
    ) -> dict[str, float]:
        """The largest difference of a recorded step's log-probability between the
        trainer and the engine, over the steps taken by the weights being trained (none:
        no metric); over every rank's steps with a sharded `backend` (collective)."""
        gap = float((trainer - engine).abs()[current].max()) if bool(current.any()) else -1.0
        if backend is not None and backend.world_size > 1:
            gap = backend.reduce_metrics({"mismatch": gap}, "max")["mismatch"]
        return {"mismatch_abs_max": gap} if gap >= 0 else {}

    def kl(self, batch: LatentBatch, distributions: list) -> torch.Tensor:
        """[B] each sample's mean over its recorded steps of KL(step policy || the
        starting model's) (`trainer.algorithm.kl.coef` > 0: the reference was frozen at
        construction)."""
        with torch.no_grad():
            reference = self.step_distributions(batch, self._reference)
        terms = [
            ((mean - ref_mean.float()) ** 2).flatten(1).sum(dim=1) / (2 * std * std)
            for (mean, std), (ref_mean, _) in zip(distributions, reference, strict=True)
        ]
        return torch.stack(terms, dim=1).mean(dim=1)
