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


def processed_logprobs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Per-row log-distribution after temperature, top-k and top-p: [B, V] -> [B, V].

    Greedy rows (temperature 0) keep the untempered distribution; their token is the argmax.
    """
    logits = logits.float()
    temperature = torch.tensor(
        [s.temperature if s.temperature > 0 else 1.0 for s in specs], dtype=logits.dtype
    )
    scaled = logits / temperature[:, None]
    top_k = [s.top_k for s in specs]
    top_p = [s.top_p for s in specs]
    if any(0 < k < logits.shape[1] for k in top_k) or any(0 < p < 1 for p in top_p):
        sorted_logits, order = scaled.sort(dim=1, descending=True)
        positions = torch.arange(logits.shape[1])[None, :]
        k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k])[:, None]
        remove = positions >= k
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=1)
        p = torch.tensor([p if 0 < p < 1 else 1.0 for p in top_p], dtype=probs.dtype)[:, None]
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        remove |= (probs.cumsum(dim=1) - probs) >= p
        remove[:, 0] = False
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    return torch.log_softmax(scaled, dim=1)


def sample_next(
    logits: torch.Tensor, specs: list[SamplingSpec], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row; returns (tokens [B], their logprobs [B]).

    Rows with a seed draw from their own generator (reproducible); the others
    are drawn together in one call.
    """
    logprobs = processed_logprobs(logits, specs)
    tokens = logprobs.argmax(dim=1)
    sampled = [row for row, spec in enumerate(specs) if spec.temperature > 0]
    shared = [row for row in sampled if generators[row] is None]
    probs = logprobs.exp()
    if shared:
        tokens[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
    for row in sampled:
        if generators[row] is not None:
            tokens[row] = int(torch.multinomial(probs[row], 1, generator=generators[row]))
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen
