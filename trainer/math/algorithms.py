"""Pure RL math over tensors: the table of advantage estimators, step-level (GiGPO)
advantages, token logprobs and entropy, and the learning-rate schedule. The policy
losses, corrections and KL estimators are `rollwire.trainer.math.losses`.

Nothing here knows about gRPC, ZeroMQ or torch.distributed; every function is
tested against numbers worked out by hand (tests/trainer/test_algorithms.py).

Shapes: B sequences in a batch, T tokens each (right-padded), G groups of N
samples (B = G * N, samples of one group adjacent).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from rollwire.services.core.config.names import ScheduleType as Schedule


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


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}"
        )
    return rewards.reshape(-1, group_size).to(torch.float64)


def grpo(*, rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): [B] rewards minus their group's mean, over the group's
    population std (+ eps); 0 for a group whose rewards are all equal."""
    return group_advantages(rewards, group_size, scale=True, eps=eps)


def dr_grpo(*, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): rewards minus their group's mean, no std; pair it with
    `aggregation: constant` for the paper's fixed length normaliser."""
    return group_advantages(rewards, group_size, scale=False)


def rloo(*, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each reward minus the mean of the other rewards of its
    group, r_i - (sum_j r_j - r_i) / (N - 1); needs groups of two or more."""
    if group_size < 2:
        raise ValueError("rloo needs groups of at least two samples")
    grouped = _grouped(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1).to(rewards.dtype)


def lite_ppo(*, rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Lite PPO (Liu et al. 2025, "Tricks or Traps", ROLL): rewards minus their group's
    mean, over the std of the whole batch's rewards (+ eps)."""
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(unbiased=False) + eps)).reshape(-1).to(rewards.dtype)


def reinforce_plus_plus(
    *,
    rewards: torch.Tensor,
    group_size: int,
    baseline: Literal["batch", "group"] = "batch",
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the reward normalised over the whole batch (minus its mean,
    over its std). `baseline: group` (REINFORCE++-baseline) first subtracts each group's
    mean, then divides by the std of those centred rewards over the batch."""
    grouped = _grouped(rewards, group_size)
    if baseline == "group":
        centred = grouped - grouped.mean(dim=1, keepdim=True)
    elif baseline == "batch":
        centred = grouped - grouped.mean()
    else:
        raise ValueError(f"unknown REINFORCE++ baseline {baseline!r}; use batch or group")
    return (centred / (centred.std(unbiased=False) + eps)).reshape(-1).to(rewards.dtype)


class RunningMoments:
    """Mean and (population) variance of every value seen so far, merged batch by batch
    (Chan et al.'s parallel update): `trainer.algorithm.reward_normalization: running`."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        """Adds a batch of values."""
        batch = values.detach().to(torch.float64).reshape(-1)
        n = batch.numel()
        if n == 0:
            return
        batch_mean = float(batch.mean())
        batch_m2 = float(((batch - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


def normalized_rewards(
    rewards: torch.Tensor, mean: float, std: float, eps: float = 1e-6
) -> torch.Tensor:
    """(rewards - mean) / (std + eps): rewards in units of their spread."""
    return ((rewards.to(torch.float64) - mean) / (std + eps)).to(rewards.dtype)


def overlong_penalty(*, lengths: torch.Tensor, max_tokens: int, buffer_tokens: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): [B] reward added to responses of
    [B] `lengths` generated tokens; 0 up to max_tokens - buffer_tokens, then falling
    linearly to -1 at max_tokens, and -1 beyond."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens} must be in 1..max_tokens={max_tokens}")
    lengths = lengths.to(torch.float64)
    free = max_tokens - buffer_tokens
    penalty = ((free - lengths) / buffer_tokens).clamp(min=-1.0, max=0.0)
    return penalty.to(torch.float32)


def final_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards: each sequence's reward ([B]) on its last generated token
    (the last 1 of `mask`), 0 elsewhere; a row without generated tokens gets none."""
    if rewards.ndim != 1 or mask.ndim != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} are not [B] and [B, T]"
        )
    out = torch.zeros(mask.shape, dtype=torch.float32)
    positions = torch.arange(mask.shape[1]).expand(mask.shape)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows].to(torch.float32)
    return out


def gae(
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the generated tokens.

    The tokens where `mask` is 1 are the actions, in order; tokens between them (a tool's
    output in a multi-turn episode) are skipped, not discounted. With d_t = r_t +
    gamma V_next - V_t (V_next = 0 after a sequence's last action), the advantage is
    A_t = d_t + gamma lam A_next and the return (the critic's target) R_t = A_t + V_t.

    Args:
        token_rewards: [B, T] reward of each action (`final_token_rewards`, plus any
            per-token KL penalty folded in).
        values: [B, T] the critic's value before each action.
        mask: [B, T] 1 on actions.
    Returns:
        (advantages, returns), both [B, T], 0 off the mask; float32.
    """
    if not token_rewards.shape == values.shape == mask.shape or mask.ndim != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)} must be one [B, T] shape"
        )
    rewards, values = token_rewards.to(torch.float64), values.to(torch.float64)
    taken = mask > 0
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=torch.float64)
    next_advantage = torch.zeros_like(next_value)
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(taken[:, t], here, 0.0)
        next_value = torch.where(taken[:, t], values[:, t], next_value)
        next_advantage = torch.where(taken[:, t], here, next_advantage)
    returns = torch.where(taken, advantages + values, 0.0)
    return advantages.to(torch.float32), returns.to(torch.float32)


def distill_advantages(
    *,
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 1.0,
) -> torch.Tensor:
    """On-policy distillation's token advantages (Agarwal et al. 2024; Lu 2025): on each
    sampled token, kl_coef x (log p_teacher - log p_student), the negative of the
    single-sample estimate of the reverse KL(student || teacher) there. No discount: a
    token is credited with its own divergence only.

    Args:
        teacher_logprobs, student_logprobs: [B, T] each model's logprob of the sampled
            token (the student's at the weights the step starts from).
        mask: [B, T] 1 on sampled tokens.
    Returns:
        [B, T] float32, 0 off the mask.
    """
    if not teacher_logprobs.shape == student_logprobs.shape == mask.shape or mask.ndim != 2:
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)}, student_logprobs "
            f"{tuple(student_logprobs.shape)} and mask {tuple(mask.shape)} must be one [B, T] shape"
        )
    gap = teacher_logprobs.to(torch.float32) - student_logprobs.to(torch.float32)
    return torch.where(mask > 0, kl_coef * gap, 0.0)


ADVANTAGE_ESTIMATORS = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "lite_ppo": lite_ppo,
    "reinforce_plus_plus": reinforce_plus_plus,
}
"""`trainer.algorithm.advantage.type` -> the estimator of one advantage per sequence, from [B]
rewards in adjacent groups of `group_size`. `episode` (StarPO) and `step` (GiGPO) start
from `grpo` (`rollwire.trainer.rl.advantages.SEQUENCE_ADVANTAGES`); `gae` and
`on_policy_distill` are per token (`TOKEN_ADVANTAGES` there)."""


def high_variance_groups(rewards: torch.Tensor, group_size: int, fraction: float) -> torch.Tensor:
    """StarPO-S's filter: [B] bool keeping the `fraction` of groups (at least one) with the
    largest reward std; ties go to the earlier group."""
    grouped = _grouped(rewards, group_size)
    spread = grouped.std(dim=1, unbiased=False)
    count = max(1, round(fraction * spread.shape[0]))
    order = sorted(range(spread.shape[0]), key=lambda g: (-float(spread[g]), g))
    keep = torch.zeros(spread.shape[0], dtype=torch.bool)
    keep[order[:count]] = True
    return keep.repeat_interleave(group_size)


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
    decay_from: Literal["warmup_end", "start"] = "warmup_end",
) -> float:
    """Multiplier of the base learning rate for optimizer update `step` (counted from 0).

    Warm-up: update k < `warmup_steps` runs at (k + 1) / warmup_steps, so the last
    warm-up update reaches the base rate. Then `constant` stays at 1, and `linear` and
    `cosine` decay from 1 at update `warmup_steps` to `min_ratio` at update
    `total_steps`, holding `min_ratio` after it (a run extended past its planned length
    does not go below it). `decay_from="start"`: the decay runs from update 0 instead,
    and the warm-up ramp, min(1, (k + 1) / warmup_steps), multiplies it.
    """
    if decay_from == "start":
        ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        return ramp * lr_factor(step, total_steps, schedule, 0, min_ratio)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {list(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = total_steps - warmup_steps
    # No span (a run no longer than its warm-up): past the warm-up is past the end.
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * SCHEDULES[schedule](progress)


SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""`lr_factor`'s shapes after the warm-up, of the progress from its end (0) to the
run's (1), scaled between 1 and min_ratio."""
