"""The steps of the pipelines around RL, on the model a `Policy` trains: supervised
fine-tuning (`rollwire sft`, with token-level distillation as its KL losses) and
preference tuning (`rollwire dpo`).

A mixin of `rollwire.trainer.model.Policy`: each public method leads the other ranks
(`Policy._lead`) and then runs its step here, split over the ranks by tokens with
padding passes as a trainer step is (`Policy._plan`), on whatever backend, precision
and LoRA the Policy holds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from rollwire.trainer.backends import split_by_tokens
from rollwire.trainer.batching import TopK, supervised_batch
from rollwire.trainer.losses import DISTILL_LOSSES, PREFERENCE_LOSSES

Sequence = tuple[list[int], list[int]]
"""Token ids and, per token, 1 where the loss is taken (`supervised_step`, preference pairs)."""


class PipelineSteps:
    """`Policy`'s supervised and preference steps (see the module docstring)."""

    backend: Any
    config: Any
    device: torch.device
    model: Any
    pad_token_id: int
    updater: Any
    optimizer_steps: int

    def supervised_step(
        self,
        sequences: list[tuple[list[int], list[int]]],
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
    ) -> dict[str, float]:
        """One optimizer update of supervised fine-tuning on (token ids, loss mask)
        sequences: the mean over their masked tokens of the negative log-likelihood
        (`loss: nll`), or of a KL to the teacher's top-k there (`forward_kl`,
        `reverse_kl`: `rollwire.trainer.losses.DISTILL_LOSSES`, `top` each sequence's),
        split over the ranks by tokens as a trainer step is. Returns loss, tokens, grad
        norm, rate. `pack_tokens`: pack the sequences into rows of at most that many
        tokens (`supervised_batch`); the loss is the same. Nothing is published: on a
        sharded backend `named_weights` keeps the last RL step's copy (a checkpoint
        consolidates the shards itself)."""
        self._lead("supervised", sequences, True, pack_tokens, loss, top)
        return self._supervised(sequences, True, pack_tokens, loss, top)

    def supervised_loss(
        self,
        sequences: list[tuple[list[int], list[int]]],
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
    ) -> dict[str, float]:
        """The same loss without an update (an evaluation; collective like a step)."""
        self._lead("supervised", sequences, False, pack_tokens, loss, top)
        return self._supervised(sequences, False, pack_tokens, loss, top)

    def _supervised(
        self,
        sequences: list[tuple[list[int], list[int]]],
        update: bool,
        pack_tokens: int | None = None,
        loss: str = "nll",
        top: list[TopK] | None = None,
    ) -> dict[str, float]:
        started = time.perf_counter()
        if loss != "nll" and top is None:
            raise ValueError(f"loss {loss} needs the teacher's top-k of every sequence")
        batch = supervised_batch(sequences, self.pad_token_id, pack_tokens, top)
        total = max(batch.tokens, 1.0)
        backend, ranks = self.backend, self.backend.world_size
        if update:
            backend.zero_grad()
        loss_sum = 0.0
        with contextlib.nullcontext() if update else torch.no_grad():
            for part in self._plan([batch])[0]:
                if loss == "nll":
                    per_token = -self.updater.logprobs(self.model, part)
                else:
                    per_token = DISTILL_LOSSES[loss](
                        logits=self.updater.logits(self.model, part),
                        top_ids=part.top_ids.to(self.device),
                        top_logprobs=part.top_logprobs.to(self.device),
                    )
                numerator = (per_token * part.mask.to(self.device)).sum()
                if update:
                    # As a trainer step: the gradient average over ranks is the token mean.
                    backend.backward(numerator * (ranks / total))
                loss_sum += float(numerator.detach())
        metrics = {"loss": backend.reduce_metrics({"loss": loss_sum}, "sum")["loss"] / total}
        metrics["tokens"] = batch.tokens
        metrics["rows"] = float(batch.input_ids.shape[0])
        if update:
            metrics.update(self._optimizer_update())
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics

    def _optimizer_update(self) -> dict[str, float]:
        """Steps the optimizer on the gradients accumulated, at the schedule's rate."""
        learning_rate = self.learning_rate()
        self.backend.set_lr(learning_rate)
        grad_norm = float(self.backend.clip_and_step(self.config.max_grad_norm))
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "learning_rate": learning_rate}

    def sequence_logprobs(
        self, pairs: list[tuple[Sequence, Sequence]]
    ) -> list[tuple[float, float]]:
        """Each preference pair's (chosen, rejected) logprob sums over their response
        tokens, under the weights as they are (DPO's reference, before any update)."""
        self._lead("preference", pairs, None, {}, False)
        return self._preference(pairs, None, {}, False)["sums"]

    def preference_step(
        self,
        pairs: list[tuple[Sequence, Sequence]],
        reference: list[tuple[float, float]],
        settings: dict[str, Any],
        update: bool = True,
    ) -> dict[str, float]:
        """One optimizer update (or, `update=False`, an evaluation) of a preference loss
        (`settings`: `loss`, a `rollwire.trainer.losses.PREFERENCE_LOSSES` name, and its
        `beta`, `gamma`; `sft_weight` adds that times the chosen response's token-mean
        NLL, as RPO does) on (chosen, rejected) pairs of (ids, mask) sequences against
        their `reference` logprob sums: the mean over pairs, split over the ranks by
        tokens. Returns the loss, the implicit reward margin, `accuracy` (pairs whose
        margin is above 0: 0 at the start, when the policy is its reference),
        `prefers_chosen` (pairs the policy itself gives the chosen response the higher
        logprob) and the logprob means."""
        self._lead("preference", pairs, reference, settings, update)
        return self._preference(pairs, reference, settings, update)

    def _preference(
        self,
        pairs: list[tuple[Sequence, Sequence]],
        reference: list[tuple[float, float]] | None,
        settings: dict[str, Any],
        update: bool,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        backend, world = self.backend, self.backend.world_size
        lengths = [len(c[0]) + len(r[0]) for c, r in pairs]
        mine = (
            split_by_tokens(lengths, world)[backend.rank] if world > 1 else list(range(len(pairs)))
        )
        size = max(1, self.config.micro_batch_size // 2)
        chunks = [mine[i : i + size] for i in range(0, len(mine), size)]
        passes = int(backend.reduce_metrics({"passes": float(len(chunks))}, "max")["passes"])
        chunks += [[]] * (passes - len(chunks))  # padding passes: forwards are collective
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
            valid = torch.tensor([float(bool(chunk))] * len(rows), device=self.device)
            sequences = [pairs[i][0] for i in rows] + [pairs[i][1] for i in rows]
            batch = supervised_batch(sequences, self.pad_token_id)
            with contextlib.nullcontext() if update else torch.no_grad():
                logprobs = self.updater.logprobs(self.model, batch)
                mask = batch.mask.to(self.device)
                per_sequence = (logprobs * mask).sum(dim=1)
                tokens = mask.sum(dim=1)
                k = len(rows)
                chosen, rejected = per_sequence[:k], per_sequence[k:]
                for index, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=False):
                    sums[index] = (c, r)
                if loss_fn is None:
                    continue
                ref = torch.tensor([reference[i] for i in rows], device=self.device)
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
            metrics.update(self._optimizer_update())
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics
