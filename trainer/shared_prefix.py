"""A group's prompt computed once: rows that begin with the same tokens share one copy.

An RL batch holds groups: several responses to one prompt, each a row that repeats the
prompt. `share_prefixes` lays a pass's rows out so that each run of rows with the same
prompt becomes one row: the prompt once, then every response after it, each response
attending to the prompt and to itself only (`packed_attention(..., prefix=True)`), its
positions continuing from the prompt's. The prompt's keys and values are computed once
and its gradient gathers what every response sends back through attention, so the
logits of every target, and the gradients, are the plain per-row computation's up to
float rounding (tests/trainer/test_shared_prefix.py).

What is shared is the rows' common beginning up to their first trained token: the
tokens before it never carry a loss, so the copy is exact whatever was generated. The
last of them goes with each response (its logits predict the response's first token),
which keeps one target per position.

`worth_sharing` weighs the layout against the plain rows for a model's sizes: fewer
tokens through the linear layers against longer rows in attention (a response sees the
whole shared row's mask, dense on the CPU's kernels), so long responses in large groups
stay as plain rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollwire.trainer.batching import TokenBatch, prefix_runs


@dataclass
class SharedLayout:
    """The rows of a `TokenBatch` with each common prompt once; see the module docstring."""

    input_ids: torch.Tensor  # [G, L]
    documents: torch.Tensor  # [G, L]: 0 the shared prompt, 1.. one per row, -1 padding
    positions: torch.Tensor  # [G, L]: each token's position in its own row
    index: torch.Tensor  # [B, T-1]: per target of the batch, the flat position g * L + l
    # whose logits predict it (padding targets point anywhere: they carry no loss)
    tokens: int  # real tokens in the layout
    plain_tokens: int  # real tokens in the batch's rows

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


def share_prefixes(batch: TokenBatch, pad_token_id: int = 0) -> SharedLayout | None:
    """The layout of `batch`'s rows with each common beginning once, or None when no two
    rows share a token before their first trained one (the plain rows are as good).

    Rows share when their tokens up to their first trained token are the same; rows in
    a shared row keep the batch's order among themselves."""
    groups, heads, lengths = prefix_runs(batch)
    size, targets = batch.mask.shape
    if all(len(group) == 1 or heads[group[0]] == 0 for group in groups):
        return None
    widths = [heads[g[0]] + sum(lengths[row] - heads[row] for row in g) for g in groups]
    width = max(widths)
    ids = torch.full((len(groups), width), pad_token_id, dtype=batch.input_ids.dtype)
    documents = torch.full((len(groups), width), -1, dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    index = torch.zeros((size, targets), dtype=torch.long)
    for g, group in enumerate(groups):
        head = heads[group[0]]
        base = g * width
        ids[g, :head] = batch.input_ids[group[0], :head]
        documents[g, :head] = 0
        positions[g, :head] = torch.arange(head)
        start = head
        for document, row in enumerate(group, start=1):
            n = lengths[row]
            end = start + n - head
            ids[g, start:end] = batch.input_ids[row, head:n]
            documents[g, start:end] = document
            positions[g, start:end] = torch.arange(head, n)
            # Targets before the segment are predicted from the shared copy, the rest
            # from the segment (its first token is the last shared one).
            index[row, :head] = base + torch.arange(head)
            index[row, head : n - 1] = base + start + torch.arange(n - 1 - head)
            index[row, n - 1 :] = base + start
            start = end
    return SharedLayout(
        input_ids=ids,
        documents=documents,
        positions=positions,
        index=index,
        tokens=sum(widths),
        plain_tokens=int(sum(lengths)),
    )


def pass_cost(rows: int, width: int, sizes: dict[str, int]) -> float:
    """Multiply-adds of a forward over `rows` rows of `width` tokens (padding included:
    attention is dense over the padded width) for a transformer of `sizes` (hidden,
    intermediate, layers, vocabulary): the linear layers and the output head per token,
    attention per pair of positions."""
    hidden, inner = sizes["hidden"], sizes["intermediate"]
    layers, vocab = sizes["layers"], sizes["vocab"]
    per_token = layers * (4 * hidden * hidden + 3 * hidden * inner) + vocab * hidden
    per_pair = layers * 2 * hidden
    return rows * width * per_token + rows * width * width * per_pair


def model_sizes(model: Any) -> dict[str, int] | None:
    """The sizes `pass_cost` takes, from a transformers model's config (or that of the
    model a wrapper holds); None when they cannot be read."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    try:
        return {
            "hidden": int(config.hidden_size),
            "intermediate": int(getattr(config, "intermediate_size", 4 * config.hidden_size)),
            "layers": int(config.num_hidden_layers),
            "vocab": int(config.vocab_size),
        }
    except (AttributeError, TypeError):
        return None


def worth_sharing(layout: SharedLayout, batch: TokenBatch, model: Any) -> bool:
    """Whether the shared layout's forward costs less than the plain rows' (by the
    model's sizes; by tokens alone when they cannot be read)."""
    sizes = model_sizes(model)
    if sizes is None:
        return layout.tokens < layout.plain_tokens
    rows, width = batch.input_ids.shape
    plain = pass_cost(int(rows), int(width), sizes)
    return pass_cost(layout.rows, layout.width, sizes) < 0.95 * plain
