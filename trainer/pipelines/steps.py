"""The steps of the pipelines around RL, on a `Learner`: supervised fine-tuning
(`SupervisedStep`: `rollwire sft` and the warm-up, with token-level distillation as its
KL losses) and preference tuning (`PreferenceStep`: `rollwire dpo`).

Each step attaches itself to the learner, so its `@collective` methods run on every
rank, split over the ranks by tokens with padding passes as an RL step is
(`Learner.plan`), on whatever backend, precision and LoRA the learner holds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from rollwire.services.core.images import ImageRef
from rollwire.trainer.batching import TopK, micro_batches, supervised_batch
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.math.algorithms import token_logprobs
from rollwire.trainer.math.losses import DISTILL_LOSSES, PREFERENCE_LOSSES

Sequence = tuple[list[int], list[int]] | tuple[list[int], list[int], list[ImageRef]]
"""Token ids and, per token, 1 where the loss is taken (`supervised_step`, preference
pairs); a preference pair's sides also carry their images when the prompt shows some."""


def _logprobs(learner: Learner, part: Any) -> torch.Tensor:
    """[B, T-1] float32 logprobs of a part's targets (temperature 1)."""
    return token_logprobs(learner.forward(part), part.targets.to(learner.device), 1.0)


class SupervisedStep:
    """Supervised steps on a learner (see the module docstring)."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        learner.attach(self, "supervised")

    def step(
        self,
        sequences: list[tuple[list[int], list[int]]],
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
        images: list[list[ImageRef]] | None = None,
    ) -> dict[str, float]:
        """One optimizer update of supervised fine-tuning on (token ids, loss mask)
        sequences: the mean over their masked tokens of the negative log-likelihood
        (`loss: nll`), or of a KL to the teacher's top-k there (`forward_kl`,
        `reverse_kl`: `rollwire.trainer.math.losses.DISTILL_LOSSES`, `top` each sequence's),
        split over the ranks by tokens as a trainer step is. Returns loss, tokens, grad
        norm, rate. `pack_tokens`: pack the sequences into rows of at most that many
        tokens (`supervised_batch`); the loss is the same. Nothing is published: on a
        sharded backend `named_weights` keeps the last RL step's copy (a checkpoint
        consolidates the shards itself). `images`: each sequence's images (a
        vision-language model)."""
        return self._supervised(sequences, True, pack_tokens, loss, top, images)

    def loss(
        self,
        sequences: list[tuple[list[int], list[int]]],
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
        images: list[list[ImageRef]] | None = None,
    ) -> dict[str, float]:
        """The same loss without an update (an evaluation; collective like a step)."""
        return self._supervised(sequences, False, pack_tokens, loss, top, images)

    @collective
    def _supervised(
        self,
        sequences: list[tuple[list[int], list[int]]],
        update: bool,
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
        images: list[list[ImageRef]] | None = None,
    ) -> dict[str, float]:
        started = time.perf_counter()
        if loss != "nll" and top is None:
            raise ValueError(f"loss {loss} needs the teacher's top-k of every sequence")
        learner = self.learner
        batch = supervised_batch(sequences, learner.pad_token_id, pack_tokens, top, images)
        total = max(batch.tokens, 1.0)
        backend, ranks = learner.backend, learner.backend.world_size
        parts = learner.plan([batch], self._parts)[0]
        if update:
            backend.zero_grad()
        loss_sum = 0.0
        with contextlib.nullcontext() if update else torch.no_grad():
            for part in parts:
                if loss == "nll":
                    per_token = -_logprobs(learner, part)
                else:
                    per_token = DISTILL_LOSSES[loss](
                        logits=learner.forward(part),
                        top_ids=part.top_ids.to(learner.device),
                        top_logprobs=part.top_logprobs.to(learner.device),
                    )
                numerator = (per_token * part.mask.to(learner.device)).sum()
                if update:
                    # As a trainer step: the gradient average over ranks is the token mean.
                    backend.backward(numerator * (ranks / total))
                loss_sum += float(numerator.detach())
        metrics = {"loss": backend.reduce_metrics({"loss": loss_sum}, "sum")["loss"] / total}
        metrics["tokens"] = batch.tokens
        metrics["rows"] = float(batch.input_ids.shape[0])
        if update:
            metrics.update(learner.optimizer_update())
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics

    def _parts(self, batch: Any) -> list[Any]:
        """A batch as the micro-batches of one forward/backward pass each."""
        config = self.learner.config
        return micro_batches(
            batch,
            config.batching.micro_batch_size,
            config.batching.max_tokens_per_micro_batch,
            config.batching.share_prefix,
        )


class PreferenceStep:
    """Preference steps on a learner (see the module docstring)."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        learner.attach(self, "preference")

    def sequence_logprobs(
        self, pairs: list[tuple[Sequence, Sequence]]
    ) -> list[tuple[float, float]]:
        """Each preference pair's (chosen, rejected) logprob sums over their response
        tokens, under the weights as they are (DPO's reference, before any update)."""
        return self._preference(pairs, None, {}, False)["sums"]

    def step(
        self,
        pairs: list[tuple[Sequence, Sequence]],
        reference: list[tuple[float, float]],
        settings: dict[str, Any],
        update: bool = True,
    ) -> dict[str, float]:
        """One optimizer update (or, `update=False`, an evaluation) of a preference loss
        (`settings`: `loss`, a `rollwire.trainer.math.losses.PREFERENCE_LOSSES` name, and its
        `beta`, `gamma`; `sft_weight` adds that times the chosen response's token-mean
        NLL, as RPO does) on (chosen, rejected) pairs of (ids, mask) sequences against
        their `reference` logprob sums: the mean over pairs, split over the ranks by
        tokens. Returns the loss, the implicit reward margin, `accuracy` (pairs whose
        margin is above 0: 0 at the start, when the policy is its reference),
        `prefers_chosen` (pairs the policy itself gives the chosen response the higher
        logprob) and the logprob means."""
        return self._preference(pairs, reference, settings, update)

    @collective
    def _preference(
        self,
        pairs: list[tuple[Sequence, Sequence]],
        reference: list[tuple[float, float]] | None,
        settings: dict[str, Any],
        update: bool,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        learner = self.learner
        backend, world, device = learner.backend, learner.backend.world_size, learner.device
        lengths = [len(c[0]) + len(r[0]) for c, r in pairs]
        chunks = learner.pair_passes(lengths)
        loss_fn = PREFERENCE_LOSSES[settings["loss"]] if reference is not None else None
        options = {k: v for k, v in settings.items() if k not in ("loss", "sft_weight")}
        sft_weight = float(settings.get("sft_weight", 0.0))
        total = float(len(pairs))
        sums: dict[int, tuple[float, float]] = {}
        totals = dict.fromkeys(("loss", "margin", "accuracy", "prefers", "chosen", "rejected"), 0.0)
        if update:
            backend.zero_grad()
        for chunk in chunks:
            rows = chunk or [0]  # a padding pass runs on a real pair and counts for nothing
            valid = torch.tensor([float(bool(chunk))] * len(rows), device=device)
            sequences = [pairs[i][0] for i in rows] + [pairs[i][1] for i in rows]
            shown = any(len(s) > 2 for s in sequences)  # (ids, mask, images): a VLM's prompt
            batch = supervised_batch(
                [s[:2] for s in sequences],
                learner.pad_token_id,
                images=[list(s[2]) if len(s) > 2 else [] for s in sequences] if shown else None,
            )
            with contextlib.nullcontext() if update else torch.no_grad():
                logprobs = _logprobs(learner, batch)
                mask = batch.mask.to(device)
                per_sequence = (logprobs * mask).sum(dim=1)
                tokens = mask.sum(dim=1)
                k = len(rows)
                chosen, rejected = per_sequence[:k], per_sequence[k:]
                for index, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=False):
                    sums[index] = (c, r)
                if loss_fn is None:
                    continue
                ref = torch.tensor([reference[i] for i in rows], device=device)
                out = loss_fn(
                    chosen=chosen,
                    rejected=rejected,
                    reference_chosen=ref[:, 0],
                    reference_rejected=ref[:, 1],
                    chosen_tokens=tokens[:k],
                    rejected_tokens=tokens[k:],
                    **options,
                )
                values = out.values
                if sft_weight:
                    # RPO: plus the chosen response's token-mean negative log-likelihood.
                    values = values - sft_weight * chosen / tokens[:k].clamp(min=1)
                numerator = (values * valid).sum()
                if update:
                    backend.backward(numerator * (world / max(total, 1.0)))
            totals["loss"] += float(numerator.detach())
            totals["margin"] += float((out.margin * valid).sum())
            totals["accuracy"] += float(((out.margin > 0).float() * valid).sum())
            prefers = (chosen.detach() > rejected.detach()).float()
            totals["prefers"] += float((prefers * valid).sum())
            totals["chosen"] += float((chosen.detach() * valid).sum())
            totals["rejected"] += float((rejected.detach() * valid).sum())
        if loss_fn is None:
            gathered = backend.all_gather_object(sums)
            merged = {index: value for part in gathered for index, value in part.items()}
            return {"sums": [merged[i] for i in range(len(pairs))]}
        summed = backend.reduce_metrics(totals, "sum")
        metrics = {
            "loss": summed["loss"] / total,
            "reward_margin": summed["margin"] / total,
            "accuracy": summed["accuracy"] / total,
            "prefers_chosen": summed["prefers"] / total,
            "chosen_logprob": summed["chosen"] / total,
            "rejected_logprob": summed["rejected"] / total,
            "pairs": total,
        }
        if update:
            metrics.update(learner.optimizer_update())
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics
