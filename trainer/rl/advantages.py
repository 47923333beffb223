"""How a trainer step's advantages are made: the rewards shaped (DAPO's overlong penalty,
normalisation), one advantage per sequence from the estimator table, or advantages per
token (a critic's GAE, REINFORCE++ with the KL in the reward, on-policy distillation's
teacher). Every `trainer.algorithm.advantage` type has its place in one of two tables:
`SEQUENCE_ADVANTAGES` (one advantage per sequence, and per turn for `step`) or
`TOKEN_ADVANTAGES` (per token, set on the step's parts). Held by the RL step
(trainer/rl/step.py); the math is `rollwire.trainer.math.algorithms`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollwire.services.core.config.algorithms import settings_of
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.math.algorithms import (
    ADVANTAGE_ESTIMATORS,
    RunningMoments,
    distill_advantages,
    group_advantages,
    high_variance_groups,
    normalized_rewards,
    overlong_penalty,
    step_advantages,
)
from rollwire.trainer.math.losses import kl_estimate
from rollwire.trainer.rl.returns import return_advantages

PerSequence = tuple[torch.Tensor, list[torch.Tensor] | None]
"""[B] advantages, and for `step` (GiGPO) each episode's per-turn ones."""


class Advantages:
    """An RL step's rewards-to-advantages part (see the module docstring): the trainer
    section, the run's rl section, the backend (for sums over ranks) and the critic of
    `advantage: gae`. Holds the running reward moments (saved with the step)."""

    def __init__(self, config: Any, rl: Any, backend: Any, critic: Any = None) -> None:
        self.config, self.rl, self.backend, self.critic = config, rl, backend, critic
        self.device: torch.device = backend.device
        self.reward_moments = RunningMoments()
        """Every reward trained on so far (trainer.algorithm.reward_normalization: running)."""

    def _shaped_rewards(
        self, trajectories: list[Trajectory], scored: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool], dict[str, float]]:
        """The [B] rewards the advantages start from (the scored ones plus DAPO's soft
        overlong penalty when trainer.algorithm.overlong.penalty_tokens is set, standardised by
        trainer.algorithm.reward_normalization), which trajectories
        the engine cut at its length limit, and their metrics."""
        overlong = self.config.algorithm.overlong
        rewards, metrics = scored, {}
        if overlong.penalty_tokens is not None:
            if overlong.max_tokens is None:
                raise ValueError(
                    "trainer.algorithm.overlong.penalty_tokens needs trainer.algorithm.overlong.max_tokens "
                    "(a run's config fills it from orchestrator.max_new_tokens)"
                )
            lengths = torch.tensor([float(t.loss_mask.sum()) for t in trajectories])
            penalty = overlong_penalty(
                lengths=lengths,
                max_tokens=overlong.max_tokens,
                buffer_tokens=overlong.penalty_tokens,
            )
            rewards = scored + penalty
            metrics["overlong_penalty_mean"] = float(penalty.mean())
        how = self.config.algorithm.reward_normalization
        if how == "batch":
            rewards = normalized_rewards(
                rewards, float(rewards.mean()), float(rewards.std(unbiased=False))
            )
        elif how == "running":
            self.reward_moments.update(rewards)
            moments = self.reward_moments
            rewards = normalized_rewards(rewards, moments.mean, moments.std)
            metrics.update(reward_running_mean=moments.mean, reward_running_std=moments.std)
        truncated = [t.finish_reason == "length" for t in trajectories]
        metrics["truncated_fraction"] = sum(truncated) / len(trajectories)
        return rewards, truncated, metrics

    @property
    def token_level(self) -> bool:
        """Advantages per token (from token rewards: a critic, or a KL in the reward; or
        on-policy distillation's teacher), not one per sequence: every sequence trains."""
        return (
            self.config.algorithm.advantage.type in TOKEN_ADVANTAGES
            or self.config.algorithm.kl.in_reward
        )

    @property
    def distilling(self) -> bool:
        """`advantage: on_policy_distill`: the token advantages are the teacher's."""
        return self.config.algorithm.advantage.type == "on_policy_distill"

    def _distill_task_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] what every generated token's advantage starts from on the token-level path:
        on-policy distillation's reward_weight x the task reward's GRPO advantage (the
        reward clipped to trainer.algorithm.reward_clip), else 0."""
        settings = self.config.algorithm.advantage
        if not self.distilling or settings.reward_weight == 0:
            return torch.zeros_like(rewards)
        clip = self.config.algorithm.reward_clip
        rewards = rewards if clip is None else rewards.clamp(-clip, clip)
        return settings.reward_weight * group_advantages(rewards, self.rl.group_size)

    def _distill_advantages(self, parts: list[TokenBatch]) -> dict[str, float]:
        """Adds the teacher's token advantages (`distill_advantages`) to every part's, from
        the proximal logprobs; returns `teacher_kl`, the batch's mean per-token estimate
        of KL(student || teacher)."""
        gap, tokens = 0.0, 0.0
        for part in parts:
            if part.teacher_logprobs is None:
                raise ValueError(
                    "advantage: on_policy_distill needs the teacher's logprobs of every "
                    "sample, and a batch came without them: the orchestrator scores them "
                    "when its config has trainer.algorithm.advantage on_policy_distill too"
                )
            mask = part.mask.to(self.device)
            teacher = part.teacher_logprobs.to(self.device)
            part.advantages = part.advantages.to(self.device) + distill_advantages(
                teacher_logprobs=teacher,
                student_logprobs=part.proximal_logprobs,
                mask=mask,
                kl_coef=self.config.algorithm.advantage.kl_coef,
            )
            gap += float(((part.proximal_logprobs - teacher) * mask).sum())
            tokens += float(mask.sum())
        summed = self.backend.reduce_metrics({"gap": gap, "tokens": tokens}, "sum")
        return {"teacher_kl": summed["gap"] / max(summed["tokens"], 1.0)}

    def _sequence_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] what each sequence's last token is rewarded on the token-level path: the
        reward clipped to trainer.algorithm.reward_clip, minus its group's mean for REINFORCE++'s
        group baseline."""
        clip = self.config.algorithm.reward_clip
        rewards = rewards if clip is None else rewards.clamp(-clip, clip)
        settings = self.config.algorithm.advantage
        if getattr(settings, "baseline", None) == "group":
            grouped = rewards.reshape(-1, self.rl.group_size)
            rewards = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
        return rewards

    def _token_advantages(self, parts: list[TokenBatch]) -> dict[str, float]:
        """Sets every part's token advantages by `TOKEN_ADVANTAGES` (REINFORCE++'s whitened
        returns to go for the sequence-level types with kl.in_reward). Returns their
        metrics."""
        how = TOKEN_ADVANTAGES.get(self.config.algorithm.advantage.type, Advantages._returns)
        return how(self, parts)

    def _returns(self, parts: list[TokenBatch]) -> dict[str, float]:
        """The KL penalty folded into the token rewards first (kl.in_reward; the proximal
        pass has set the logprobs it needs), then the critic's GAE, or REINFORCE++'s
        whitened returns to go."""
        metrics: dict[str, float] = {}
        kl = self.config.algorithm.kl
        if kl.in_reward:
            penalty, tokens = 0.0, 0.0
            for part in parts:
                mask = part.mask.to(self.device)
                estimate = kl_estimate(
                    part.proximal_logprobs, part.reference_logprobs, kl.estimator
                )
                estimate = estimate * mask
                part.token_rewards = part.token_rewards.to(self.device) - kl.coef * estimate
                penalty += float(estimate.sum())
                tokens += float(mask.sum())
            summed = self.backend.reduce_metrics({"kl": penalty, "tokens": tokens}, "sum")
            metrics["kl"] = summed["kl"] / max(summed["tokens"], 1.0)
        if self.critic is not None:
            metrics.update(self.critic.prepare(parts))
        else:
            return_advantages(parts, self.backend)
        return metrics

    def advantages(self, trajectories: list[Trajectory], rewards: torch.Tensor) -> PerSequence:
        """[B] advantages by `trainer.algorithm.advantage` (`SEQUENCE_ADVANTAGES`; of rewards
        clipped to trainer.algorithm.reward_clip when set), and for `step` (GiGPO) each episode's
        per-turn ones."""
        settings = self.config.algorithm.advantage
        if settings.type not in SEQUENCE_ADVANTAGES:
            raise ValueError(f"advantage: {settings.type} gives its advantages per token")
        if self.config.algorithm.reward_clip is not None:
            rewards = rewards.clamp(
                -self.config.algorithm.reward_clip, self.config.algorithm.reward_clip
            )
        return SEQUENCE_ADVANTAGES[settings.type](self, trajectories, rewards)

    def _estimated(self, trajectories: list[Trajectory], rewards: torch.Tensor) -> PerSequence:
        """A group estimator of `rollwire.trainer.math.algorithms.ADVANTAGE_ESTIMATORS`."""
        settings = self.config.algorithm.advantage
        estimate = ADVANTAGE_ESTIMATORS[settings.type]
        group_size = self.rl.group_size
        return estimate(rewards=rewards, group_size=group_size, **settings_of(settings)), None

    def _episode(self, trajectories: list[Trajectory], rewards: torch.Tensor) -> PerSequence:
        """StarPO: an episode's group advantage; with keep_groups_fraction < 1 (StarPO-S)
        the groups whose rewards vary least are zeroed, which leaves them out of the step."""
        settings, group_size = self.config.algorithm.advantage, self.rl.group_size
        advantages = group_advantages(rewards, group_size)
        if settings.keep_groups_fraction < 1:
            kept = high_variance_groups(rewards, group_size, settings.keep_groups_fraction)
            advantages = advantages * kept
        return advantages, None

    def _step(self, trajectories: list[Trajectory], rewards: torch.Tensor) -> PerSequence:
        """GiGPO: the episode's group advantage plus each turn's, from the step rewards of
        turns taken in the same state."""
        settings, group_size = self.config.algorithm.advantage, self.rl.group_size
        scale = settings.scale
        advantages = group_advantages(rewards, group_size, scale=scale)
        per_turn = step_advantages(
            advantages,
            [t.turn_keys for t in trajectories],
            [t.step_rewards.tolist() for t in trajectories],
            group_size,
            gamma=settings.gamma,
            weight=settings.weight,
            scale=scale,
        )
        return advantages, per_turn


SEQUENCE_ADVANTAGES: dict[
    str, Callable[[Advantages, list[Trajectory], torch.Tensor], PerSequence]
] = {
    **dict.fromkeys(ADVANTAGE_ESTIMATORS, Advantages._estimated),
    "episode": Advantages._episode,
    "step": Advantages._step,
}
"""`trainer.algorithm.advantage` types with one advantage per sequence (and per turn)."""

TOKEN_ADVANTAGES: dict[str, Callable[[Advantages, list[TokenBatch]], dict[str, float]]] = {
    "gae": Advantages._returns,  # the critic's GAE, after the KL folded in (if any)
    "on_policy_distill": Advantages._distill_advantages,
}
"""`trainer.algorithm.advantage` types with advantages per token, set on the step's parts."""
