"""Token-level advantages without a critic, and the whitening over ranks they share with
one: REINFORCE++ with the KL folded into the reward (`return_advantages`), and
`whiten_advantages` (used by the critic's GAE as well).
"""

from __future__ import annotations

import torch

from rollwire.trainer.backends import TrainBackend
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.math.algorithms import gae


def whiten_advantages(parts: list[TokenBatch], backend: TrainBackend, apply: bool = True) -> float:
    """The std of the parts' token `advantages` over every rank's generated tokens; when
    `apply`, sets each part's to (A - mean) / (std + 1e-6) on its mask (0 off it).
    Collective: every rank calls it with its own parts."""
    device = backend.device
    sums = {"tokens": 0.0, "sum": 0.0, "squares": 0.0}
    for part in parts:
        mask = part.mask.to(device)
        values = part.advantages.to(device) * mask
        sums["tokens"] += float(mask.sum())
        sums["sum"] += float(values.sum())
        sums["squares"] += float((values**2).sum())
    total = backend.reduce_metrics(sums, "sum")
    count = max(total["tokens"], 1.0)
    mean = total["sum"] / count
    std = max(total["squares"] / count - mean**2, 0.0) ** 0.5
    if apply:
        for part in parts:
            mask = part.mask.to(device)
            part.advantages = (part.advantages.to(device) - mean) / (std + 1e-6) * mask
    return std


def return_advantages(parts: list[TokenBatch], backend: TrainBackend) -> None:
    """REINFORCE++ with the KL in the reward: each generated token's advantage is its
    return to go (the sum of the token rewards from it to the sequence's end), whitened
    over every rank's tokens. Collective."""
    device = backend.device
    for part in parts:
        mask = part.mask.to(device)
        _, returns = gae(
            token_rewards=part.token_rewards.to(device),
            values=torch.zeros(mask.shape, device=device),
            mask=mask,
            gamma=1.0,
            lam=1.0,
        )
        part.advantages = returns
    whiten_advantages(parts, backend)
