"""Pure RL math over tensors: advantages, the clipped policy loss, KL estimators,
entropy and the learning-rate schedule.

Nothing here knows about gRPC, ZeroMQ or torch.distributed; every function is
tested against numbers worked out by hand (tests/test_algorithms.py).

Shapes: B sequences in a batch, T tokens each (right-padded), G groups of N
samples (B = G * N, samples of one group adjacent).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Correction = Literal["none", "tis"]
Schedule = Literal["constant", "linear", "cosine"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std when `scale`.

    Args:
        rewards: [B] final rewards, B a multiple of `group_size`, groups adjacent.
        scale: divide by the group's (population) std; False gives Dr. GRPO's unscaled form.
    Returns:
        [B] advantages; zero for a group whose rewards are all equal.
    """
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}"
        )
    grouped = rewards.reshape(-1, group_size).to(torch.float64)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1).to(rewards.dtype)


def discounted_returns(step_rewards: Sequence[float], gamma: float) -> list[float]:
    """Return of each turn: its reward plus `gamma` times the next turn's return."""
    returns = [0.0] * len(step_rewards)
    running = 0.0
    for turn in range(len(step_rewards) - 1, -1, -1):
        running = float(step_rewards[turn]) + gamma * running
        returns[turn] = running
    return returns


def step_advantages(
    episode_advantages: torch.Tensor,
    turn_keys: Sequence[Sequence[str]],
    step_rewards: Sequence[Sequence[float]],
    group_size: int,
    gamma: float = 0.95,
    weight: float = 1.0,
    scale: bool = True,
    eps: float = 1e-6,
) -> list[torch.Tensor]:
    """Per-turn advantages in the manner of GiGPO: episode-level plus step-level.

    Within one group (episodes of the same seed), the turns taken in the same
    state — equal `turn_keys` — form a step group; each such turn's discounted
    return (`discounted_returns`) is compared with the others of its step group
    (minus the mean, divided by the std when `scale`). A state visited only once
    has no peers and adds nothing. The result for turn t of episode i is
    `episode_advantages[i] + weight * step_advantage[i, t]`.

    Args:
        episode_advantages: [B] advantages of whole episodes (`group_advantages`).
        turn_keys: B lists, one key per turn.
        step_rewards: B lists of per-turn rewards, as long as the episode's keys.
    Returns:
        B tensors of shape [turns] (empty for an episode without turns).
    """
    size = episode_advantages.shape[0]
    if len(turn_keys) != size or len(step_rewards) != size or size % group_size:
        raise ValueError(
            f"{size} episode advantages, {len(turn_keys)} key lists and {len(step_rewards)} "
            f"reward lists do not form groups of {group_size}"
        )
    returns = []
    for index, (keys, rewards) in enumerate(zip(turn_keys, step_rewards, strict=True)):
        if len(keys) != len(rewards):
            raise ValueError(
                f"episode {index} has {len(keys)} turn keys but {len(rewards)} step rewards"
            )
        returns.append(discounted_returns(rewards, gamma))
    step = [[0.0] * len(keys) for keys in turn_keys]
    for first in range(0, size, group_size):
        peers: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for episode in range(first, first + group_size):
            for turn, key in enumerate(turn_keys[episode]):
                peers[key].append((episode, turn))
        for members in peers.values():
            if len(members) < 2:
                continue
            values = torch.tensor([returns[e][t] for e, t in members], dtype=torch.float64)
            centred = values - values.mean()
            if scale:
                centred = centred / (values.std(unbiased=False) + eps)
            for (episode, turn), value in zip(members, centred.tolist(), strict=True):
                step[episode][turn] = value
    base = episode_advantages.to(torch.float64)
    return [
        (base[i] + weight * torch.tensor(step[i], dtype=torch.float64)).to(episode_advantages.dtype)
        for i in range(size)
    ]


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy.

    Non-negative, unbiased under samples from the policy, low variance.
    """
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where mask is 1 (token-level aggregation); 0 when none are."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    metrics: dict[str, float]
    """Ratio, clipping and importance-weight statistics over the masked tokens."""


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    correction: Correction = "tis",
    tis_cap: float = 2.0,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher, token-level aggregation and an explicit
    off-policy correction.

    ratio = pi / pi_old, clipped to [1 - clip_low, 1 + clip_high] (clip-higher: a
    larger upper bound keeps low-probability tokens learnable). What pi_old is
    depends on `correction`:

    - "none": pi_old is the behaviour policy (the engine's logprobs): plain PPO.
    - "tis": pi_old is the proximal policy (the trainer's own logprobs before this
      update, `proximal_logprobs`), and each token is weighted by the truncated
      importance weight min(pi_prox / mu, tis_cap) against the behaviour policy
      mu. This corrects for stale tokens and for engine/trainer mismatch.

    Args:
        logprobs: [B, T] current policy logprobs of the taken tokens (with grad).
        proximal_logprobs: [B, T] trainer logprobs before the update (no grad).
        behaviour_logprobs: [B, T] engine logprobs recorded at generation.
        advantages: [B] or [B, T].
        mask: [B, T] 1 on tokens the policy generated.
        reference_logprobs: [B, T] reference-model logprobs, for the KL penalty.
    """
    mask_f = mask.to(logprobs.dtype)
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    if correction == "none":
        old = behaviour_logprobs
        weight = torch.ones_like(logprobs)
    elif correction == "tis":
        old = proximal_logprobs
        weight = torch.exp(proximal_logprobs - behaviour_logprobs).clamp(max=tis_cap).detach()
    else:
        raise ValueError(f"unknown off-policy correction {correction!r}; use 'none' or 'tis'")
    ratio = torch.exp(logprobs - old.detach())
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    per_token = -weight * surrogate
    loss = masked_mean(per_token, mask_f)
    metrics: dict[str, float] = {}
    if reference_logprobs is not None and kl_coef > 0:
        kl = masked_mean(kl_k3(logprobs, reference_logprobs.detach()), mask_f)
        loss = loss + kl_coef * kl
        metrics["kl"] = float(kl.detach())
    with torch.no_grad():
        selected = mask_f > 0
        r = ratio[selected]
        a = advantages[selected]
        if r.numel():
            # A token is clipped when the clipped branch is the one min() picked.
            clipped_high = ((r > 1 + clip_high) & (a > 0)).float().mean()
            clipped_low = ((r < 1 - clip_low) & (a < 0)).float().mean()
            raw_weight = torch.exp(proximal_logprobs - behaviour_logprobs)[selected]
            metrics.update(
                ratio_mean=float(r.mean()),
                ratio_max=float(r.max()),
                ratio_min=float(r.min()),
                clip_frac_high=float(clipped_high),
                clip_frac_low=float(clipped_low),
                is_weight_mean=float(raw_weight.mean()),
                is_weight_max=float(raw_weight.max()),
                is_truncated_frac=float((raw_weight > tis_cap).float().mean())
                if correction == "tis"
                else 0.0,
                behaviour_kl=float((behaviour_logprobs - proximal_logprobs)[selected].mean()),
            )
    return PolicyLossOutput(loss=loss, metrics=metrics)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each next token: logits [B, T, V] predict tokens [B, T] -> [B, T].

    `logits[:, t]` must already be the prediction for `tokens[:, t]` (shifted by
    the caller). Divides by `temperature` first, matching what the engine sampled from.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return torch.gather(torch.log_softmax(scaled, dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy in nats of each position's next-token distribution: logits [B, T, V] -> [B, T].

    Computed in float32 after dividing by `temperature`: the distribution the engine
    sampled from, as in `token_logprobs`.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def lr_factor(
    step: int,
    total_steps: int,
    schedule: Schedule = "constant",
    warmup_steps: int = 0,
    min_ratio: float = 0.0,
) -> float:
    """Multiplier of the base learning rate for optimizer update `step` (counted from 0).

    Warm-up: update k < `warmup_steps` runs at (k + 1) / warmup_steps, so the last
    warm-up update reaches the base rate. Then `constant` stays at 1, and `linear` and
    `cosine` decay from 1 at update `warmup_steps` to `min_ratio` at update
    `total_steps`, holding `min_ratio` after it (a run extended past its planned length
    does not go below it).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = total_steps - warmup_steps
    # No span (a run no longer than its warm-up): past the warm-up is past the end.
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use 'constant', 'linear' or 'cosine'")
    return min_ratio + (1.0 - min_ratio) * shape
