"""How a trainer step's advantages are made: the rewards shaped (DAPO's overlong penalty,
normalisation), one advantage per sequence from the estimator table, or advantages per
token (a critic's GAE, REINFORCE++ with the KL in the reward, on-policy distillation's
teacher). A mixin of `rollwire.trainer.model.Policy`; the math is
`rollwire.trainer.algorithms`'.
"""

from __future__ import annotations

from typing import Any

import torch

from rollwire.services.core.config.algorithms import settings_of
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    distill_advantages,
    group_advantages,
    high_variance_groups,
    normalized_rewards,
    overlong_penalty,
    step_advantages,
)
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.critic import return_advantages
from rollwire.trainer.losses import kl_estimate


class Advantages:
    """`Policy`'s rewards-to-advantages part (see the module docstring)."""

    config: Any
    rl: Any
    backend: Any
    critic: Any
    device: torch.device
    reward_moments: Any

    def _shaped_rewards(
        self, trajectories: list[Trajectory], scored: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool], dict[str, float]]:
        """The [B] rewards the advantages start from (the scored ones plus DAPO's soft
        overlong penalty when trainer.overlong.penalty_tokens is set, standardised by
        trainer.reward_normalization), which trajectories
        the engine cut at its length limit, and their metrics."""
        overlong = self.config.overlong
        rewards, metrics = scored, {}
        if overlong.penalty_tokens is not None:
            if overlong.max_tokens is None:
                raise ValueError(
                    "trainer.overlong.penalty_tokens needs trainer.overlong.max_tokens "
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
        how = self.config.reward_normalization
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
        return self.critic is not None or self.config.kl.in_reward or self.distilling

    @property
    def distilling(self) -> bool:
        """`advantage: on_policy_distill`: the token advantages are the teacher's."""
        return self.config.advantage.type == "on_policy_distill"

    def _distill_task_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] what every generated token's advantage starts from on the token-level path:
        on-policy distillation's reward_weight x the task reward's GRPO advantage (the
        reward clipped to trainer.reward_clip), else 0."""
        settings = self.config.advantage
        if not self.distilling or settings.reward_weight == 0:
            return torch.zeros_like(rewards)
        clip = self.config.reward_clip
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
                    "when its config has trainer.advantage on_policy_distill too"
                )
            mask = part.mask.to(self.device)
            teacher = part.teacher_logprobs.to(self.device)
            part.advantages = part.advantages.to(self.device) + distill_advantages(
                teacher_logprobs=teacher,
                student_logprobs=part.proximal_logprobs,
                mask=mask,
                kl_coef=self.config.advantage.kl_coef,
            )
            gap += float(((part.proximal_logprobs - teacher) * mask).sum())
            tokens += float(mask.sum())
        summed = self.backend.reduce_metrics({"gap": gap, "tokens": tokens}, "sum")
        return {"teacher_kl": summed["gap"] / max(summed["tokens"], 1.0)}

    def _sequence_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] what each sequence's last token is rewarded on the token-level path: the
        reward clipped to trainer.reward_clip, minus its group's mean for REINFORCE++'s
        group baseline."""
        clip = self.config.reward_clip
        rewards = rewards if clip is None else rewards.clamp(-clip, clip)
        settings = self.config.advantage
        if getattr(settings, "baseline", None) == "group":
            grouped = rewards.reshape(-1, self.rl.group_size)
            rewards = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
        return rewards

    def _token_advantages(self, parts: list[TokenBatch]) -> dict[str, float]:
        """Sets every part's token advantages: the KL penalty folded into its token rewards
        first (kl.in_reward; the proximal pass has set the logprobs it needs), then the
        critic's GAE, or REINFORCE++'s whitened returns to go. Returns their metrics."""
        if self.distilling:
            return self._distill_advantages(parts)
        metrics: dict[str, float] = {}
        kl = self.config.kl
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

    def advantages(
        self, trajectories: list[Trajectory], rewards: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """[B] advantages by `trainer.advantage` (of rewards clipped to trainer.reward_clip
        when set), and for `step` (GiGPO) each episode's
        per-turn ones. `episode` with keep_groups_fraction < 1 (StarPO-S) zeroes the
        groups whose rewards vary least, which leaves them out of the step."""
        settings = self.config.advantage
        group_size = self.rl.group_size
        if settings.type in ("gae", "on_policy_distill"):
            raise ValueError(f"advantage: {settings.type} gives its advantages per token")
        if self.config.reward_clip is not None:
            rewards = rewards.clamp(-self.config.reward_clip, self.config.reward_clip)
        if settings.type in ADVANTAGE_ESTIMATORS:
            estimate = ADVANTAGE_ESTIMATORS[settings.type]
            return estimate(rewards=rewards, group_size=group_size, **settings_of(settings)), None
        scale = getattr(settings, "scale", True)
        advantages = group_advantages(rewards, group_size, scale=scale)
        if settings.type == "episode":
            if settings.keep_groups_fraction < 1:
                kept = high_variance_groups(rewards, group_size, settings.keep_groups_fraction)
                advantages = advantages * kept
            return advantages, None
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
