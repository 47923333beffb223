"""The passes of one RL step: the proximal pass ahead of the first update, and the
gradient of one minibatch over its micro-batches, each forward the learner's (the model
family's, in the configured precision).

`RLStep.train_step` (trainer/rl/step.py) decides how many updates there are; this
module does each one. The loss math is `rollwire.trainer.math`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollwire.services.core.config import TrainerConfig
from rollwire.services.core.config.algorithms import settings_of
from rollwire.trainer.batching import TokenBatch, micro_batches
from rollwire.trainer.learner import Learner
from rollwire.trainer.math.algorithms import token_entropy, token_logprobs
from rollwire.trainer.math.losses import aggregate, policy_objective


class MismatchStats:
    """Sums of the engine's logprobs against the trainer's, over tokens of one version."""

    def __init__(self) -> None:
        self.tokens, self.abs_sum, self.abs_max, self.kl_sum = 0.0, 0.0, 0.0, 0.0

    def add(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds the tokens where `mask` is 1."""
        count = float(mask.sum())
        if count == 0:
            return
        log_ratio = (trainer - engine) * mask
        self.tokens += count
        self.abs_sum += float(log_ratio.abs().sum())
        self.abs_max = max(self.abs_max, float(log_ratio.abs().max()))
        # KL(engine || trainer) on the engine's own samples, the k3 estimator:
        # r - 1 - log r with r = p_trainer / p_engine, never negative.
        self.kl_sum += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())

    def metrics(self) -> dict[str, float]:
        """`mismatch_*` metrics over the tokens added."""
        if not self.tokens:
            return {"mismatch_tokens": 0.0}
        return {
            "mismatch_tokens": self.tokens,
            "mismatch_abs_mean": self.abs_sum / self.tokens,
            "mismatch_abs_max": self.abs_max,
            "mismatch_kl": self.kl_sum / self.tokens,
        }


class Observed:
    """What the pre-update pass saw: train/inference mismatch and the policy's entropy,
    as sums, so the parts of several ranks add up (`merged`)."""

    def __init__(self) -> None:
        self.mismatch = MismatchStats()
        self.entropy_sum, self.count = 0.0, 0.0

    @staticmethod
    def merged(parts: list[Observed]) -> Observed:
        """The sums of every part (one per rank)."""
        total = Observed()
        for part in parts:
            m, t = part.mismatch, total.mismatch
            t.tokens, t.abs_sum, t.kl_sum = (
                t.tokens + m.tokens,
                t.abs_sum + m.abs_sum,
                t.kl_sum + m.kl_sum,
            )
            t.abs_max = max(t.abs_max, m.abs_max)
            total.entropy_sum += part.entropy_sum
            total.count += part.count
        return total

    def metrics(self) -> dict[str, float]:
        """`mismatch_*` and `entropy_mean`."""
        return {**self.mismatch.metrics(), "entropy_mean": self.entropy_sum / max(self.count, 1.0)}


def average(rows: list[dict[str, float]], weights: list[float] | None = None) -> dict[str, float]:
    """Weighted means of metric dicts (equal weights by default), except that keys
    ending in `_max` or `_min` take the extreme; a key missing from a row is skipped."""
    weights = weights or [1.0] * len(rows)
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}
    for row, weight in zip(rows, weights, strict=True):
        for key, value in row.items():
            if key.endswith("_max"):
                sums[key] = max(sums.get(key, value), value)
            elif key.endswith("_min"):
                sums[key] = min(sums.get(key, value), value)
            else:
                sums[key] = sums.get(key, 0.0) + value * weight
                totals[key] = totals.get(key, 0.0) + weight
    return {
        key: (value / totals[key] if totals[key] else 0.0) if key in totals else value
        for key, value in sums.items()
    }


class Updater:
    """Runs the forward and backward passes of an RL step on the learner's model: the
    micro-batching and the loss settings come from the trainer config. `reference` (the
    KL's frozen model) is anything called like a model: with LoRA, the learner's own
    model with its adapters off (`rollwire.trainer.learner.AdaptersOff`)."""

    def __init__(
        self,
        learner: Learner,
        reference: Callable[..., Any] | None,
        config: TrainerConfig,
        temperature: float,
    ) -> None:
        self.learner, self.model, self.reference = learner, learner.model, reference
        self.config, self.temperature, self.device = config, temperature, learner.device

    def parts(self, batch: TokenBatch) -> list[TokenBatch]:
        """`batch` as the micro-batches one forward/backward pass each takes."""
        return micro_batches(
            batch,
            self.config.batching.micro_batch_size,
            self.config.batching.max_tokens_per_micro_batch,
            self.config.batching.share_prefix,
        )

    def logits(self, model: Callable[..., Any], batch: TokenBatch) -> torch.Tensor:
        """[B, T-1, V] next-token logits for `batch.targets`, in the model's compute dtype."""
        return self.learner.forward(batch, model)

    def logprobs(self, model: Callable[..., Any], batch: TokenBatch) -> torch.Tensor:
        """[B, T-1] float32 logprobs of the targets at the sampling temperature."""
        # token_logprobs upcasts: log-softmax over bf16 logits would lose the small ones.
        return token_logprobs(
            self.logits(model, batch), batch.targets.to(self.device), self.temperature
        )

    def _observe(
        self,
        part: TokenBatch,
        logits: torch.Tensor,
        logprobs: torch.Tensor,
        trainer_version: int,
        seen: Observed,
    ) -> None:
        """Adds the mismatch and entropy of one part, from its pre-update logits."""
        mask = part.mask.to(self.device)
        # Tokens the engine sampled from exactly these weights: any difference between
        # its logprobs and ours is train/inference mismatch, not staleness.
        same_weights = mask * (part.policy_versions.to(self.device) == trainer_version)
        seen.mismatch.add(logprobs.detach(), part.behaviour_logprobs.to(self.device), same_weights)
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), self.temperature)
        seen.entropy_sum += float((entropy * mask).sum())
        seen.count += float(mask.sum())

    @torch.no_grad()
    def proximal_pass(self, parts: list[TokenBatch], trainer_version: int) -> Observed:
        """Before a step's first update: sets each part's proximal (and reference)
        logprobs from the weights as they are, and returns what it saw (mismatch,
        entropy). Run on the very parts the updates take, so the first update's ratio is
        exactly 1 (same shapes, same kernels)."""
        seen = Observed()
        for part in parts:
            logits = self.logits(self.model, part)
            logprobs = token_logprobs(logits, part.targets.to(self.device), self.temperature)
            part.proximal_logprobs = logprobs
            if self.reference is not None:
                part.reference_logprobs = self.logprobs(self.reference, part)
            self._observe(part, logits, logprobs, trainer_version, seen)
        return seen

    def denominator(self, batch: TokenBatch) -> float:
        """What the loss of `batch` is divided by under `trainer.algorithm.aggregation` (its tokens,
        its sequences, or sequences x the constant): the sum over its parts."""
        zeros = torch.zeros(batch.mask.shape, dtype=torch.float32)
        return aggregate(
            zeros,
            batch.mask,
            self.config.algorithm.aggregation,
            self.config.algorithm.aggregation_constant or 1.0,
        )[1]

    def accumulate(
        self,
        parts: list[TokenBatch],
        trainer_version: int,
        observe: bool = False,
        *,
        total: float | None = None,
        ranks: int = 1,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[list[dict[str, float]], list[float], Observed | None]:
        """Backpropagates the loss of one minibatch (`rollwire.trainer.math.losses.policy_objective`
        aggregated over all its parts) into the parameters' gradients, one part at a
        time; returns each part's loss metrics and its share of the minibatch's
        denominator and, when `observe` (the step's only update, so its weights are the
        proximal ones), what `proximal_pass` would have seen.

        Across ranks: `parts` are this rank's, `total` the minibatch's denominator over
        all `ranks` (`denominator`), whose gradients the backend averages; each part's
        numerator is divided by `total` and multiplied by `ranks`, so the average is the
        minibatch's loss. `backward` is the backend's (plain `loss.backward()` by default).

        A part without `proximal_logprobs` takes its own detached logprobs as proximal:
        right only before the step's first update.
        """
        config = self.config
        backward = backward or torch.Tensor.backward
        if total is None:
            total = sum(self.denominator(part) for part in parts)
        total = max(total, 1e-12)
        rows, shares = [], []
        seen = Observed() if observe else None
        for part in parts:
            logits = self.logits(self.model, part)
            logprobs = token_logprobs(logits, part.targets.to(self.device), self.temperature)
            if seen is not None:
                self._observe(part, logits, logprobs, trainer_version, seen)
            entropy = (
                token_entropy(logits, self.temperature)
                if config.algorithm.entropy_coef > 0
                else None
            )
            del logits
            reference = part.reference_logprobs
            if reference is None and self.reference is not None:
                with torch.no_grad():
                    reference = self.logprobs(self.reference, part)
            proximal = part.proximal_logprobs
            out = policy_objective(
                logprobs=logprobs,
                proximal_logprobs=logprobs.detach()
                if proximal is None
                else proximal.to(self.device),
                behaviour_logprobs=part.behaviour_logprobs.to(self.device),
                advantages=part.advantages.to(self.device),
                mask=part.mask.to(self.device),
                loss=config.algorithm.loss.type,
                loss_settings=settings_of(config.algorithm.loss),
                correction=config.algorithm.correction.type,
                correction_settings=settings_of(config.algorithm.correction),
                aggregation=config.algorithm.aggregation,
                constant=config.algorithm.aggregation_constant or 1.0,
                reference_logprobs=None if reference is None else reference.to(self.device),
                kl_coef=0.0 if config.algorithm.kl.in_reward else config.algorithm.kl.coef,
                kl_estimator=config.algorithm.kl.estimator,
                entropy=entropy,
                entropy_coef=config.algorithm.entropy_coef,
            )
            # Each part's numerator over the whole minibatch's denominator: the parts add
            # up to the minibatch's loss, whatever the split. A padding part (no tokens)
            # still runs forward and backward: on sharded backends both are collective.
            backward(out.numerator * (ranks / total))
            local = out.numerator.detach() / max(out.denominator, 1e-12)
            rows.append({"loss": float(local), **out.metrics})
            shares.append(out.denominator / total)
        return rows, shares, seen
