"""The value model of `trainer.algorithm.advantage: gae` (PPO with a critic).

A second model on the same backend and ranks as the policy: the policy's transformer
(or `critic.model_path`) with a zeroed one-output head, its own AdamW. In a step,
`prepare` runs it over the parts the policy's updates take, turns its values and the
token rewards into GAE advantages and lambda-returns (`rollwire.trainer.math.algorithms.gae`)
and whitens the advantages over the whole batch (every rank's tokens); after the
policy's updates `update` fits it to the returns with PPO's clipped value loss, by the
same minibatches and epochs. Saved in a checkpoint's `critic/` by the backend's own
`save` (the sharded state on `fsdp2` and `deepspeed`), restored with the policy.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from rollwire.services.core.config import TrainerConfig
from rollwire.services.core.config.algorithms import GAEAdvantage
from rollwire.trainer.backends import TrainBackend, adamw_settings, make_backend
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.learner import in_precision
from rollwire.trainer.math.algorithms import gae
from rollwire.trainer.math.losses import value_loss
from rollwire.trainer.models import ModelFamily
from rollwire.trainer.rl.returns import whiten_advantages
from rollwire.trainer.rl.update import average

log = logging.getLogger(__name__)


class Critic:
    """The value model: values of a part's generated tokens, the step's advantages and
    returns, and its own updates. Every rank holds one and runs every call (forward
    passes are collective on `fsdp2` and ZeRO-3)."""

    def __init__(
        self,
        settings: GAEAdvantage,
        config: TrainerConfig,
        policy_model_path: Path,
        family: ModelFamily | None = None,
    ) -> None:
        self.settings, self.config = settings, config
        critic = settings.critic
        self.learning_rate = critic.learning_rate or config.optimizer.learning_rate
        self.max_grad_norm = critic.max_grad_norm or config.optimizer.max_grad_norm
        optimizer = replace(adamw_settings(config), lr=self.learning_rate)
        self.backend: TrainBackend = make_backend(
            config.backend,
            critic.model_path or policy_model_path,
            optimizer,
            device=config.device,
            precision=config.precision,
            gradient_checkpointing=config.gradient_checkpointing,
            distributed=config.distributed,
            max_grad_norm=self.max_grad_norm,
            value_head=True,
            family=family,
        )

    def values(self, part: TokenBatch) -> torch.Tensor:
        """[B, T-1] float32 value before each target token (with grad): the head's output
        at the position that predicts it."""
        backend = self.backend
        # The forward pass in the trainer's precision, as the policy's.
        with in_precision(self.config.precision, backend.device):
            logits = backend.family.logits(backend.module, part, backend.device)
        return logits[..., 0].float()

    @torch.no_grad()
    def prepare(self, parts: list[TokenBatch]) -> dict[str, float]:
        """Sets each part's `old_values`, `returns` and `advantages` (whitened over every
        rank's parts when `whiten`) from its `token_rewards`; returns value metrics of
        the whole batch."""
        device = self.backend.device
        sums = dict.fromkeys(("tokens", "ret", "ret_sq", "res", "res_sq", "value"), 0.0)
        for part in parts:
            mask = part.mask.to(device)
            old = self.values(part) * mask
            advantages, returns = gae(
                token_rewards=part.token_rewards.to(device),
                values=old,
                mask=mask,
                gamma=self.settings.gamma,
                lam=self.settings.lam,
            )
            part.old_values, part.returns, part.advantages = old, returns, advantages
            residual = (returns - old) * mask
            sums["tokens"] += float(mask.sum())
            sums["ret"] += float(returns.sum())
            sums["ret_sq"] += float((returns**2).sum())
            sums["res"] += float(residual.sum())
            sums["res_sq"] += float((residual**2).sum())
            sums["value"] += float(old.sum())
        total = self.backend.reduce_metrics(sums, "sum")
        count = max(total["tokens"], 1.0)
        adv_std = whiten_advantages(parts, self.backend, apply=self.settings.whiten)
        ret_mean = total["ret"] / count
        ret_var = max(total["ret_sq"] / count - ret_mean**2, 0.0)
        res_mean = total["res"] / count
        res_var = max(total["res_sq"] / count - res_mean**2, 0.0)
        return {
            "critic_value_mean": total["value"] / count,
            "critic_return_mean": ret_mean,
            "critic_advantage_std": adv_std,
            # 1: the values explain the returns; 0 or below: no better than their mean.
            "critic_explained_variance": 1.0 - res_var / ret_var if ret_var > 0 else 0.0,
        }

    def update(
        self, plan: list[list[TokenBatch]], tokens: list[float], lr_factor: float
    ) -> dict[str, float]:
        """epochs_per_step passes over the minibatches of `plan` (this rank's parts of
        each; `tokens`: each minibatch's generated tokens over every rank), one critic
        update each, at the critic's rate times `lr_factor` (the trainer's schedule);
        returns the mean of the updates' metrics."""
        backend, device = self.backend, self.backend.device
        clip = self.settings.critic.value_clip
        ranks = backend.world_size
        rows: list[dict[str, float]] = []
        for _ in range(self.config.batching.epochs_per_step):
            for parts, total in zip(plan, tokens, strict=True):
                backend.zero_grad()
                loss_sum, clipped_sum = 0.0, 0.0
                for part in parts:
                    mask = part.mask.to(device)
                    per_token, clipped = value_loss(
                        values=self.values(part),
                        old_values=part.old_values,
                        returns=part.returns,
                        mask=mask,
                        clip=clip,
                    )
                    numerator = per_token.sum()
                    # As the policy's: the gradient average over ranks is the token mean.
                    backend.backward(numerator * (ranks / max(total, 1.0)))
                    loss_sum += float(numerator.detach())
                    clipped_sum += float(clipped.sum())
                backend.set_lr(self.learning_rate * lr_factor)
                grad_norm = backend.clip_and_step(self.max_grad_norm)
                summed = backend.reduce_metrics({"loss": loss_sum, "clipped": clipped_sum}, "sum")
                rows.append(
                    {
                        "critic_loss": summed["loss"] / max(total, 1.0),
                        "critic_clip_frac": summed["clipped"] / max(total, 1.0),
                        "critic_grad_norm": float(grad_norm),
                    }
                )
        return average(rows)

    def save(self, folder: Path) -> None:
        """Weights and optimizer state into `folder` (collective on sharded backends)."""
        self.backend.save(folder)

    def load(self, folder: Path) -> None:
        """What `save` wrote; a checkpoint without a critic leaves this one as it starts."""
        if not folder.is_dir():
            log.warning("%s: no critic in this checkpoint; the critic starts afresh", folder)
            return
        self.backend.load(folder)

    def close(self) -> None:
        self.backend.close()
