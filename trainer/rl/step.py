"""The RL step: whole groups of scored trajectories in, optimizer updates of the learner out.

`RLStep.train_step` shapes the rewards and makes the advantages (`Advantages`, by the
tables in trainer/rl/advantages.py), collates the sequences with signal, cuts them into
minibatches and micro-batches (`Learner.plan`), runs the proximal pass when the weights
move within the step, and makes epochs_per_step x minibatches_per_step updates
(`Updater`: the loss tables of `rollwire.trainer.math.losses`); a critic
(`advantage: gae`) is updated after them. Knows nothing of gRPC or ZeroMQ.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.timing import PhaseClock
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import TokenBatch, collate, per_token_advantages, split_rows
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.math.algorithms import final_token_rewards
from rollwire.trainer.rl.advantages import Advantages
from rollwire.trainer.rl.critic import Critic
from rollwire.trainer.rl.update import Observed, Updater, average


class RLStep:
    """The RL step on a learner: its KL reference, critic and advantages. Build one on
    every rank (it attaches itself to the learner, so `train_step` is collective)."""

    def __init__(self, learner: Learner, config: TrainerConfig, rl: RLSection) -> None:
        self.learner, self.config, self.rl = learner, config, rl
        learner.total_updates = rl.max_steps * self.updates_per_step
        self.reference: Any = learner.frozen_reference() if config.algorithm.kl.coef > 0 else None
        self.updater = Updater(learner, self.reference, config, rl.temperature)
        self.critic: Critic | None = None
        """`advantage: gae`: the value model, on the same backend and ranks."""
        if config.algorithm.advantage.type == "gae":
            self.critic = Critic(
                config.algorithm.advantage, config, learner.model_path, learner.family
            )
        self.advantages = Advantages(config, rl, learner.backend, self.critic)
        self.update_metrics: list[dict[str, float]] = []
        """The loss metrics of each optimizer update of the last step, in order."""
        learner.attach(self, "rl")

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step makes when every minibatch has sequences."""
        return self.config.batching.minibatches_per_step * self.config.batching.epochs_per_step

    @collective
    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        """One trainer step on whole groups: epochs_per_step x minibatches_per_step
        optimizer updates against the proximal logprobs of the weights it started from
        (one policy version); returns metrics, the loss ones averaged over the updates.

        Over several ranks each minibatch is split by tokens (`Learner.plan`), every
        rank runs as many passes as the busiest (padding passes carry no tokens), and the
        metrics are those of the whole batch."""
        started = time.perf_counter()
        learner, shaping = self.learner, self.advantages
        scored = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        rewards, truncated, metrics = shaping._shaped_rewards(trajectories, scored)
        if shaping.token_level:
            # Advantages per token, per part: below (on top of the task's, when distilling).
            advantages, per_turn = shaping._distill_task_advantages(rewards), None
            keep = list(range(len(trajectories)))
        else:
            advantages, per_turn = shaping.advantages(trajectories, rewards)
            # Sequences with zero advantage carry no gradient: leave them out entirely.
            keep = [
                i
                for i in range(len(trajectories))
                if float(advantages[i]) != 0.0
                or (per_turn is not None and bool(per_turn[i].abs().sum() > 0))
            ]
        if self.config.algorithm.overlong.mask_truncated:
            # DAPO's overlong filtering: in the group's statistics, out of the loss.
            keep = [i for i in keep if not truncated[i]]
        metrics |= {
            "reward_mean": float(scored.mean()),
            "reward_std": float(scored.std(unbiased=False)),
            "sequences": float(len(trajectories)),
            "sequences_with_signal": float(len(keep)),
        }
        shown = sum(len(t.images) for t in trajectories)
        if shown:  # a vision-language batch: how many images its forward passes take
            metrics["images"] = float(shown)
        if per_turn is not None:
            step_parts = [turns - advantages[i] for i, turns in enumerate(per_turn)]
            nonempty = [part for part in step_parts if part.numel()]
            metrics["step_advantage_abs_mean"] = (
                float(torch.cat(nonempty).abs().mean()) if nonempty else 0.0
            )
        generated = np.concatenate([t.policy_versions[t.loss_mask == 1] for t in trajectories])
        if generated.size:
            metrics["staleness_mean"] = float(trainer_version - generated.mean())
            metrics["staleness_max"] = float(trainer_version - generated.min())
        metrics["response_tokens_mean"] = float(generated.size / len(trajectories))
        self.update_metrics = []
        if not keep:
            metrics.update(
                loss=0.0,
                grad_norm=0.0,
                optimizer_steps=0.0,
                learning_rate=learner.learning_rate(),
                step_seconds=time.perf_counter() - started,
            )
            return metrics
        kept = [trajectories[i] for i in keep]
        batch = collate(kept, learner.pad_token_id)
        batch.advantages = per_token_advantages(
            kept,
            advantages[keep],
            None if per_turn is None else [per_turn[i] for i in keep],
            batch.mask.shape[1],
        )
        if shaping.token_level and not shaping.distilling:
            batch.token_rewards = final_token_rewards(
                shaping._sequence_rewards(rewards)[keep], batch.mask
            )
        minibatches = [
            batch if len(rows) == len(keep) else batch.select(rows)
            for rows in split_rows(len(keep), self.config.batching.minibatches_per_step)
        ]
        # The micro-batches are cut once and reused by every epoch.
        plan = learner.plan(minibatches, self.updater.parts)
        metrics.update(self._updates(plan, minibatches, trainer_version, started))
        return metrics

    def _updates(
        self,
        plan: list[list[TokenBatch]],
        minibatches: list[TokenBatch],
        trainer_version: int,
        started: float,
    ) -> dict[str, float]:
        """The step's updates on this rank's parts of each minibatch, and their metrics
        (`step_seconds` from `started` to the last update, before the gather)."""
        learner, backend = self.learner, self.learner.backend
        totals = [self.updater.denominator(minibatch) for minibatch in minibatches]
        # One update per step: its weights are the proximal ones, and its own forward
        # gives their logprobs (no extra pass). More: the weights move after the first
        # update, so the proximal logprobs must be taken before it; so must a KL that
        # goes into the rewards.
        ahead = (
            len(plan) * self.config.batching.epochs_per_step > 1
            or self.config.algorithm.kl.in_reward
            or self.advantages.distilling
        )
        observed: list[Observed] = []
        parts = [part for minibatch_parts in plan for part in minibatch_parts]
        clock = PhaseClock()
        metrics: dict[str, float] = {}
        if ahead:
            with clock.phase("proximal"):
                observed.append(self.updater.proximal_pass(parts, trainer_version))
        if self.advantages.token_level:
            metrics.update(self.advantages._token_advantages(parts))
        for _ in range(self.config.batching.epochs_per_step):
            for mine, total in zip(plan, totals, strict=True):
                backend.zero_grad()
                with clock.phase("forward_backward"):
                    rows, shares, seen = self.updater.accumulate(
                        mine,
                        trainer_version,
                        observe=not ahead,
                        total=total,
                        ranks=backend.world_size,
                        backward=backend.backward,
                    )
                if seen is not None:
                    observed.append(seen)
                with clock.phase("optimizer"):
                    update = learner.optimizer_update()
                # Every rank's parts: the minibatch's token means.
                everyone = backend.all_gather_object((rows, shares))
                out = average(
                    [row for rank_rows, _ in everyone for row in rank_rows],
                    [share for _, rank_shares in everyone for share in rank_shares],
                )
                out.update(update)
                self.update_metrics.append(out)
        metrics.update(average(self.update_metrics))
        if self.critic is not None:
            factor = learner.learning_rate() / self.config.optimizer.learning_rate
            tokens = [minibatch.tokens for minibatch in minibatches]
            with clock.phase("critic"):
                metrics.update(self.critic.update(plan, tokens, factor))
        seen_by_all = [part for parts in backend.all_gather_object(observed) for part in parts]
        metrics.update(Observed.merged(seen_by_all).metrics())
        metrics["optimizer_steps"] = float(len(self.update_metrics))
        metrics["step_seconds"] = time.perf_counter() - started
        if learner.sharded:
            with clock.phase("gather"):
                learner.gather()
        metrics.update(clock.times())
        return metrics

    def logprobs(self, model: torch.nn.Module, batch: TokenBatch, rows: slice) -> torch.Tensor:
        """[rows, T-1] logprobs of `batch`'s targets at full width (for tests and tools)."""
        part = dataclasses.replace(
            batch,
            input_ids=batch.input_ids[rows],
            attention=batch.attention[rows],
            targets=batch.targets[rows],
        )
        return self.updater.logprobs(model, part)

    # ------------------------------------------------------------- checkpoints

    def save_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Into a checkpoint: the running reward moments, and the critic in `critic/`."""
        state["reward_moments"] = self.advantages.reward_moments.state_dict()
        if self.critic is not None:
            self.critic.save(folder / "critic")

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        """What `save_state` wrote (a checkpoint without it leaves them as they start)."""
        if self.critic is not None:
            self.critic.load(folder / "critic")
        if "reward_moments" in state:
            self.advantages.reward_moments.load_state_dict(state["reward_moments"])

    def close(self) -> None:
        if self.critic is not None:
            self.critic.close()
