"""Turning next-token logits into a sampled token and its behaviour logprob.

The logprob returned is that of the sampled token under the distribution the
token was actually drawn from: logits divided by the temperature, then top-k
and top-p truncation, renormalised. That is what the trainer's off-policy
correction needs (it recomputes the same quantity at the same temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request (mirrors `rollwire.v1.SamplingParams`)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept; 1 keeps everything."""
    top_k: int = 0
    """Most likely tokens kept; 0 keeps everything."""
    max_new_tokens: int = 64
    stop_token_ids: frozenset[int] = frozenset()
    seed: int | None = None


class SamplingBatch:
    """The sampling parameters of a batch's rows as tensors, built once per batch layout
    so each decoding step does no per-row Python work (seeded rows excepted: each draws
    from its own generator)."""

    def __init__(
        self,
        specs: list[SamplingSpec],
        generators: list[torch.Generator | None] | None = None,
        shared_generator: torch.Generator | None = None,
    ) -> None:
        """`generators`: each row's own (None: the row draws with the others, from
        `shared_generator`, or torch's global generator when that is None)."""
        self.shared_generator = shared_generator
        self.temperature = torch.tensor(
            [s.temperature if s.temperature > 0 else 1.0 for s in specs], dtype=torch.float32
        )[:, None]
        self.top_k = [s.top_k for s in specs]
        self.top_p = [s.top_p for s in specs]
        self._truncated: tuple[torch.Tensor, torch.Tensor] | None = None
        sampled = torch.tensor([s.temperature > 0 for s in specs], dtype=torch.bool)
        generators = generators or [None] * len(specs)
        self.seeded = [
            (row, generator)
            for row, (spec, generator) in enumerate(zip(specs, generators, strict=True))
            if spec.temperature > 0 and generator is not None
        ]
        shared = sampled.clone()
        for row, _ in self.seeded:
            shared[row] = False
        self.shared = shared.nonzero().squeeze(1) if shared.any() else None
        self.all_shared = bool(shared.all())

    def _truncation(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k [B, 1], p [B, 1]) when some row truncates its distribution, else None."""
        if not (any(0 < k < vocab for k in self.top_k) or any(0 < p < 1 for p in self.top_p)):
            return None
        if self._truncated is None:
            self._truncated = (
                torch.tensor([k if 0 < k < vocab else vocab for k in self.top_k])[:, None],
                torch.tensor([p if 0 < p < 1 else 1.0 for p in self.top_p])[:, None],
            )
        return self._truncated

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row log-distribution after temperature, top-k and top-p: [B, V] -> [B, V].

        Greedy rows (temperature 0) keep the untempered distribution; their token is the
        argmax."""
        scaled = logits.float() / self.temperature
        truncation = self._truncation(logits.shape[1])
        if truncation is not None:
            k, p = truncation
            sorted_logits, order = scaled.sort(dim=1, descending=True)
            positions = torch.arange(logits.shape[1])[None, :]
            remove = positions >= k
            probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=1)
            # Drop a token when the mass before it already reaches top_p (the first stays).
            remove |= (probs.cumsum(dim=1) - probs) >= p.to(probs.dtype)
            remove[:, 0] = False
            scaled = scaled.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
        return torch.log_softmax(scaled, dim=1)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draws one token per row; returns (tokens [B], their logprobs [B]). Rows with a
        seed draw from their own generator (reproducible); the others in one call."""
        logprobs = self.logprobs(logits)
        probs = logprobs.exp()
        if self.all_shared:
            tokens = torch.multinomial(probs, 1, generator=self.shared_generator).squeeze(1)
        else:
            tokens = logprobs.argmax(dim=1)
            if self.shared is not None:
                tokens[self.shared] = torch.multinomial(
                    probs[self.shared], 1, generator=self.shared_generator
                ).squeeze(1)
            for row, generator in self.seeded:
                tokens[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens, chosen


def processed_logprobs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Per-row log-distribution after temperature, top-k and top-p: [B, V] -> [B, V]."""
    return SamplingBatch(specs).logprobs(logits)


def sample_next(
    logits: torch.Tensor, specs: list[SamplingSpec], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row; returns (tokens [B], their logprobs [B])."""
    return SamplingBatch(specs, generators).sample(logits)
