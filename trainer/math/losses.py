"""Pure math of the policy loss: off-policy corrections, the table of policy losses,
loss aggregation, KL estimators, and `policy_objective`, which composes them.

Nothing here knows about gRPC, ZeroMQ or torch.distributed; each entry is tested
against numbers worked out by hand (tests/trainer/test_losses.py). Shapes: B sequences of T
tokens, right-padded; `mask` [B, T] is 1 on the tokens the policy generated.

Three logprobs of each generated token meet here: the **behaviour** ones (mu, the
engine's, recorded at sampling), the **proximal** ones (the trainer's weights before
this step's first update) and the **current** ones (the weights being updated, with
grad). A correction decides which of mu and pi_prox the ratio is taken against and
how each token is weighted or masked; a policy loss turns ratio and advantage into a
per-token loss; the aggregation turns per-token values into one number.

Adding a policy loss: one function taking keyword-only tensors and returning a
`TokenLoss`, one entry in `POLICY_LOSSES`, one config class in
`services/core/config/algorithms.py`, one test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollwire.services.core.config.names import Aggregation, KLEstimator

# ---------------------------------------------------------------- corrections


@dataclass
class Correction:
    """What an off-policy correction gives the loss."""

    old_logprobs: torch.Tensor
    """[B, T] the logprobs the ratio is taken against (no grad)."""
    weight: torch.Tensor
    """[B, T] each token's importance weight (no grad)."""
    keep: torch.Tensor
    """[B, T] 1 for the tokens the loss uses, 0 for those the correction masks out."""
    truncates: bool = False
    """The weights are capped (`tis`): a weight below the raw one was truncated."""


def no_correction(
    *, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor
) -> Correction:
    """Plain PPO: the ratio against the behaviour policy itself, every weight 1."""
    ones = torch.ones_like(behaviour_logprobs)
    return Correction(behaviour_logprobs.detach(), ones, ones)


def _behaviour_weight(proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    return torch.exp(proximal - behaviour).detach()


def tis(
    *, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float = 2.0
) -> Correction:
    """Truncated importance sampling: the ratio against the proximal policy, each token
    weighted by min(pi_prox / mu, cap) (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training")."""
    weight = _behaviour_weight(proximal_logprobs, behaviour_logprobs).clamp(max=cap)
    return Correction(proximal_logprobs.detach(), weight, torch.ones_like(weight), truncates=True)


def decoupled(
    *, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float = 5.0
) -> Correction:
    """AReaL's decoupled PPO (Fu et al. 2025): the clipped ratio against the proximal
    policy, times the weight pi_prox / mu; tokens whose weight exceeds `cap` are left
    out rather than truncated."""
    weight = _behaviour_weight(proximal_logprobs, behaviour_logprobs)
    keep = (weight <= cap).to(weight.dtype)
    return Correction(proximal_logprobs.detach(), weight * keep, keep)


def mis(
    *,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Masked importance sampling: the ratio against the proximal policy, no weight, and
    tokens whose weight pi_prox / mu lies outside [low, high] masked out."""
    weight = _behaviour_weight(proximal_logprobs, behaviour_logprobs)
    keep = ((weight >= low) & (weight <= high)).to(weight.dtype)
    return Correction(proximal_logprobs.detach(), keep, keep)


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "none": no_correction,
    "tis": tis,
    "decoupled": decoupled,
    "mis": mis,
}
"""`trainer.algorithm.correction.type` -> the correction."""

# ---------------------------------------------------------------- policy losses


@dataclass
class TokenLoss:
    """A policy loss per token, before weights, masks and aggregation."""

    values: torch.Tensor
    """[B, T] the loss of each token (to be minimised), with grad."""
    ratio: torch.Tensor
    """[B, T] the ratio pi / pi_old the loss saw (per sequence for `gspo`), no grad."""
    clipped_high: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """[B, T] bool: tokens whose gradient the upper clip removed (empty: none can be)."""
    clipped_low: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """[B, T] bool: the same for the lower clip (and the dual clip)."""


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs - old_logprobs.detach())


def ppo_clip(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> TokenLoss:
    """PPO's clipped surrogate per token (Schulman et al. 2017), with separate low and
    high clips (clip-higher, DAPO) and, for negative advantages, the dual clip c
    (Ye et al. 2020): the surrogate is then bounded below by c * A."""
    ratio = _ratio(logprobs, old_logprobs)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        high = (ratio > 1 + clip_high) & (advantages > 0)
        low = (ratio < 1 - clip_low) & (advantages < 0)
    if dual_clip is not None:
        floor = dual_clip * advantages
        negative = advantages < 0
        with torch.no_grad():
            low = low | (negative & (surrogate < floor))
        surrogate = torch.where(negative, torch.maximum(surrogate, floor), surrogate)
    return TokenLoss(-surrogate, ratio.detach(), high, low)


def gspo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> TokenLoss:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token
    ratios, clipped per sequence; the sequence's surrogate is put on each of its
    tokens, so `seq_mean_token_mean` aggregation averages sequences. `advantages`
    [B, T] must be constant along each sequence (the first generated token's is used)."""
    mask_f = mask.to(logprobs.dtype)
    lengths = mask_f.sum(dim=1).clamp(min=1)
    log_ratio = ((logprobs - old_logprobs.detach()) * mask_f).sum(dim=1) / lengths
    ratio = torch.exp(log_ratio)  # [B]
    first = mask_f.argmax(dim=1, keepdim=True)
    advantage = advantages.gather(1, first).squeeze(1)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage)
    with torch.no_grad():
        high = ((ratio > 1 + clip_high) & (advantage > 0))[:, None].expand_as(mask_f)
        low = ((ratio < 1 - clip_low) & (advantage < 0))[:, None].expand_as(mask_f)
    per_token = (-surrogate)[:, None].expand_as(mask_f)
    return TokenLoss(per_token, ratio.detach()[:, None].expand_as(mask_f), high, low)


def cispo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | None = None,
    clip_high: float = 0.28,
) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): the importance ratio clipped and detached, times the
    advantage and the log-likelihood's gradient, so no token loses its gradient to a
    clip. No lower bound unless `clip_low` is set."""
    ratio = _ratio(logprobs, old_logprobs).detach()
    weight = ratio.clamp(max=1 + clip_high)
    if clip_low is not None:
        weight = weight.clamp(min=1 - clip_low)
    return TokenLoss(-weight * advantages * logprobs, ratio)


def topr(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> TokenLoss:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025): positive-advantage
    sequences take the plain REINFORCE gradient, negative ones are weighted by the
    ratio truncated to [0, 1] (detached)."""
    ratio = _ratio(logprobs, old_logprobs).detach()
    weight = torch.where(advantages >= 0, torch.ones_like(ratio), ratio.clamp(0.0, 1.0))
    return TokenLoss(-weight * advantages * logprobs, ratio)


def raft_plus_plus(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> TokenLoss:
    """RAFT++ (Xiong et al. 2025): learn only from the accepted samples, those with a
    positive advantage (better than their group), by PPO's clipped surrogate with
    advantage 1; the others contribute nothing."""
    accepted = (advantages > 0).to(logprobs.dtype)
    out = ppo_clip(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=accepted,
        mask=mask,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    return TokenLoss(out.values * accepted, out.ratio, out.clipped_high, out.clipped_low)


def reinforce(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> TokenLoss:
    """REINFORCE (Williams 1992): -A log pi per token; off-policy only through the
    correction's weights."""
    return TokenLoss(-advantages * logprobs, _ratio(logprobs, old_logprobs).detach())


POLICY_LOSSES: dict[str, Callable[..., TokenLoss]] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "topr": topr,
    "raft_plus_plus": raft_plus_plus,
    "reinforce": reinforce,
}
"""`trainer.algorithm.loss.type` -> the policy loss."""

# ---------------------------------------------------------------- aggregation and KL


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token_mean", constant: float = 1.0
) -> tuple[torch.Tensor, float]:
    """(numerator, denominator) of the loss of `values` [B, T] over the tokens of `mask`.

    The loss is numerator / denominator; numerators and denominators of several parts
    (micro-batches, ranks) add up, so their sum gives the loss of the whole batch:
    - `token_mean`: the mean over all tokens (long sequences weigh more);
    - `seq_mean_token_sum`: the mean over sequences of their token sums;
    - `seq_mean_token_mean`: the mean over sequences of their token means (each sequence
      weighs the same, GRPO's original);
    - `constant`: the token sum over sequences x `constant` (Dr. GRPO: a fixed length
      normaliser, no length bias).
    A sequence without generated tokens counts in none of them.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; use one of {list(AGGREGATIONS)}")
    mask_f = mask.to(values.dtype)
    summed = values * mask_f
    tokens = mask_f.sum(dim=1)
    return AGGREGATIONS[how](summed, tokens, float((tokens > 0).sum()), constant)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], tuple]] = {
    "token_mean": lambda summed, tokens, sequences, constant: (summed.sum(), float(tokens.sum())),
    "seq_mean_token_sum": lambda summed, tokens, sequences, constant: (summed.sum(), sequences),
    "seq_mean_token_mean": lambda summed, tokens, sequences, constant: (
        (summed.sum(dim=1) / tokens.clamp(min=1)).sum(),
        sequences,
    ),
    "constant": lambda summed, tokens, sequences, constant: (summed.sum(), sequences * constant),
}
"""`aggregate`'s ways, each (masked values, tokens per row, sequences, constant) ->
(numerator, denominator)."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where mask is 1 (token-level aggregation); 0 when none are."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_estimate(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman,
    "Approximating KL divergence"), with d = log ref - log pi: `k1` = -d (unbiased, high
    variance, can be negative), `k2` = d^2 / 2 (low variance, biased), `k3` =
    exp(d) - d - 1 (unbiased, low variance, never negative)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {list(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](reference_logprobs.detach() - logprobs)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda delta: -delta,
    "k2": lambda delta: 0.5 * delta**2,
    "k3": lambda delta: torch.exp(delta) - delta - 1,
}
"""`kl_estimate`'s estimators, each of d = log ref - log pi."""


def value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's per-token loss, PPO's clipped squared error: 0.5 max((V - R)^2,
    (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -clip, clip), so one update
    cannot move a value far from where the step began; plain 0.5 (V - R)^2 when `clip`
    is None. All [B, T]; returns (loss [B, T] with grad, clipped [B, T] bool), 0 and
    False off the mask."""
    taken = mask > 0
    error = (values - returns) ** 2
    if clip is None:
        per_token, clipped = 0.5 * error, torch.zeros_like(taken)
    else:
        moved = old_values + torch.clamp(values - old_values, -clip, clip)
        error_clipped = (moved - returns) ** 2
        per_token = 0.5 * torch.maximum(error, error_clipped)
        clipped = error_clipped > error
    return per_token * taken, clipped & taken


# ---------------------------------------------------------------- the objective


@dataclass
class Objective:
    """The loss of one part of a batch, as a numerator over a denominator (`aggregate`)."""

    numerator: torch.Tensor
    """Scalar with grad: policy loss (+ KL, - entropy bonus) summed the aggregation's way."""
    denominator: float
    """What the numerators of all parts are divided by, summed over the parts."""
    metrics: dict[str, float]
    """Ratio, clip, weight and mask statistics over this part's generated tokens."""


def policy_objective(
    *,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss: str = "ppo_clip",
    loss_settings: dict | None = None,
    correction: str = "tis",
    correction_settings: dict | None = None,
    aggregation: Aggregation = "token_mean",
    constant: float = 1.0,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> Objective:
    """The correction, then the policy loss weighted and masked by it, then the KL term
    (`kl_coef` x the estimator, when reference logprobs are given) and the entropy bonus
    (`entropy_coef` x `entropy` [B, T], with grad), aggregated the same way.

    `advantages` may be [B] (one per sequence) or [B, T].
    """
    if loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; use one of {sorted(POLICY_LOSSES)}")
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {correction!r}; use one of {sorted(CORRECTIONS)}"
        )
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    fix = CORRECTIONS[correction](
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        **(correction_settings or {}),
    )
    out = POLICY_LOSSES[loss](
        logprobs=logprobs,
        old_logprobs=fix.old_logprobs,
        advantages=advantages,
        mask=mask,
        **(loss_settings or {}),
    )
    mask_f = mask.to(logprobs.dtype)
    # Masked tokens add nothing but still count in the denominator: the aggregation is
    # over the batch's generated tokens, whatever the correction drops.
    per_token = out.values * fix.weight * fix.keep
    numerator, denominator = aggregate(per_token, mask_f, aggregation, constant)
    metrics: dict[str, float] = {}
    if reference_logprobs is not None and kl_coef > 0:
        kl = kl_estimate(logprobs, reference_logprobs, kl_estimator)
        kl_sum, _ = aggregate(kl, mask_f, aggregation, constant)
        numerator = numerator + kl_coef * kl_sum
        metrics["kl"] = float(masked_mean(kl.detach(), mask_f))
    if entropy is not None and entropy_coef > 0:
        entropy_sum, _ = aggregate(entropy, mask_f, aggregation, constant)
        numerator = numerator - entropy_coef * entropy_sum
    metrics.update(_statistics(out, fix, proximal_logprobs, behaviour_logprobs, advantages, mask_f))
    return Objective(numerator, denominator, metrics)


@torch.no_grad()
def _statistics(
    out: TokenLoss,
    fix: Correction,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask_f: torch.Tensor,
) -> dict[str, float]:
    selected = mask_f > 0
    if not bool(selected.any()):
        return {}
    ratio = out.ratio[selected]
    raw_weight = torch.exp(proximal - behaviour)[selected]
    stats = {
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
        "clip_frac_high": float(out.clipped_high[selected].float().mean())
        if out.clipped_high.numel()
        else 0.0,
        "clip_frac_low": float(out.clipped_low[selected].float().mean())
        if out.clipped_low.numel()
        else 0.0,
        "is_weight_mean": float(raw_weight.mean()),
        "is_weight_max": float(raw_weight.max()),
        # Tokens whose weight the correction truncated, and tokens it masked out.
        "is_truncated_frac": float((fix.weight[selected] < raw_weight).float().mean())
        if fix.truncates
        else 0.0,
        "is_masked_frac": float((fix.keep[selected] == 0).float().mean()),
        "behaviour_kl": float((behaviour - proximal)[selected].mean()),
        "advantage_abs_mean": float(advantages[selected].abs().mean()),
    }
    return stats


# ---------------------------------------------------------------- preference losses


@dataclass
class PreferenceLoss:
    """Per-pair losses of a preference objective, [P], with what it compares."""

    values: torch.Tensor
    """[P] the loss of each pair (with grad)."""
    margin: torch.Tensor
    """[P] the implicit reward of the chosen minus that of the rejected (detached)."""


def _log_ratio_margin(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
) -> torch.Tensor:
    return (chosen - reference_chosen) - (rejected - reference_rejected)


def dpo(
    *,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float = 0.1,
    gamma: float = 0.0,
) -> PreferenceLoss:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta h), h the chosen's log-ratio to the
    reference minus the rejected's; the implicit reward margin is beta h. All [P]:
    sequence logprob sums of the policy and the (frozen) reference."""
    h = _log_ratio_margin(chosen, rejected, reference_chosen, reference_rejected)
    return PreferenceLoss(-torch.nn.functional.logsigmoid(beta * h), (beta * h).detach())


def ipo(
    *,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float = 0.1,
    gamma: float = 0.0,
) -> PreferenceLoss:
    """IPO (Azar et al. 2023): (h - 1 / (2 beta))^2, the same h as DPO: a bounded target
    margin instead of an ever-growing one."""
    h = _log_ratio_margin(chosen, rejected, reference_chosen, reference_rejected)
    return PreferenceLoss((h - 1 / (2 * beta)) ** 2, h.detach())


def simpo(
    *,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> PreferenceLoss:
    """SimPO (Meng et al. 2024): -log sigmoid(beta (chosen / |chosen| - rejected /
    |rejected|) - gamma): length-normalised logprobs, a target margin gamma, and no
    reference (its logprobs are ignored)."""
    margin = beta * (chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1))
    return PreferenceLoss(-torch.nn.functional.logsigmoid(margin - gamma), margin.detach())


PREFERENCE_LOSSES: dict[str, Callable[..., PreferenceLoss]] = {
    "dpo": dpo,
    "ipo": ipo,
    "simpo": simpo,
}
"""`dpo.loss` -> the per-pair loss, from [P] sequence logprob sums of the chosen and
rejected responses under the policy and the reference, and their token counts."""


# ---------------------------------------------------------------- token-level distillation


def _bucketed(
    logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's log-probabilities of K + 1 outcomes: each of the
    teacher's top-k tokens, and "any other token" (what the k leave of the mass), both
    [B, T, K + 1] float32. The teacher's logprobs are its full-vocabulary ones."""
    if (
        logits.ndim != 3
        or top_ids.shape != top_logprobs.shape
        or top_ids.shape[:2] != logits.shape[:2]
    ):
        raise ValueError(
            f"logits {tuple(logits.shape)}, top_ids {tuple(top_ids.shape)} and top_logprobs "
            f"{tuple(top_logprobs.shape)} must be [B, T, V], [B, T, K] and [B, T, K]"
        )

    def with_rest(logprobs: torch.Tensor) -> torch.Tensor:
        kept = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=-1e-6)
        rest = torch.log(-torch.expm1(kept)).clamp(min=-30.0)  # log(1 - exp(kept))
        return torch.cat([logprobs, rest], dim=-1)

    student = torch.log_softmax(logits.float(), dim=-1).gather(-1, top_ids.long())
    return with_rest(student), with_rest(top_logprobs.float().clamp(max=0.0))


def topk_forward_kl(
    *, logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor
) -> torch.Tensor:
    """Forward KL(teacher || student) on the teacher's top-k tokens and one bucket for
    every other token (Hinton et al. 2015, on sparse teacher logits): sum over the K + 1
    outcomes of pT (log pT - log pS), both from full-vocabulary probabilities, so it is
    0 only when the student gives each of the k tokens, and the rest, the teacher's
    mass. Mass-covering. [B, T] per position, from logits [B, T, V] and top-k [B, T, K]."""
    student, teacher = _bucketed(logits, top_ids, top_logprobs)
    return (teacher.exp() * (teacher - student)).sum(dim=-1)


def topk_reverse_kl(
    *, logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor
) -> torch.Tensor:
    """Reverse KL(student || teacher) on the same K + 1 outcomes (mode-seeking, as in
    MiniLLM, Gu et al. 2024): sum of pS (log pS - log pT). The "other" bucket keeps the
    student from moving its mass off the teacher's k tokens for free. [B, T] per
    position."""
    student, teacher = _bucketed(logits, top_ids, top_logprobs)
    return (student.exp() * (student - teacher)).sum(dim=-1)


DISTILL_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "forward_kl": topk_forward_kl,
    "reverse_kl": topk_reverse_kl,
}
"""`sft.loss` (beside `nll`) -> the per-position loss against the teacher's top-k
logprobs that `rollwire distill generate` recorded (distill.top_k)."""
