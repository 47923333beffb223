"""The trainer's algorithm settings: advantage estimator, policy loss, off-policy correction,
KL. Each is a union on `type` whose entries are `rollwire.trainer.math.algorithms.ADVANTAGE_ESTIMATORS`,
`rollwire.trainer.math.losses.POLICY_LOSSES` and `rollwire.trainer.math.losses.CORRECTIONS`.

Imports neither torch nor grpc; each field's docstring is its help text. A section
without `type` takes the default entry (`trainer.algorithm.loss: {clip_high: 0.3}` is `ppo_clip`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from rollwire.services.core.config.names import KLEstimator
from rollwire.services.core.config.runtime import TYPE_SHORTHAND, StrictModel

# ---------------------------------------------------------------- advantage estimators


class GRPOAdvantage(StrictModel):
    """GRPO: each reward minus its group's mean, over the group's std."""

    type: Literal["grpo"] = "grpo"


class DrGRPOAdvantage(StrictModel):
    """Dr. GRPO: each reward minus its group's mean, no std (use with
    `trainer.algorithm.aggregation: constant` for the paper's length normaliser)."""

    type: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantage(StrictModel):
    """RLOO: each reward minus the mean of the other rewards of its group."""

    type: Literal["rloo"] = "rloo"


class LitePPOAdvantage(StrictModel):
    """Lite PPO: group-mean centring, normalised by the std of the whole batch."""

    type: Literal["lite_ppo"] = "lite_ppo"


class ReinforcePlusPlusAdvantage(StrictModel):
    """REINFORCE++: rewards normalised over the whole batch."""

    type: Literal["reinforce_plus_plus"] = "reinforce_plus_plus"
    baseline: Literal["batch", "group"] = "batch"
    """`batch`: minus the batch's mean reward; `group` (REINFORCE++-baseline): minus each
    group's mean, then over the batch's std."""


class EpisodeAdvantage(StrictModel):
    """StarPO: one GRPO advantage per whole (multi-turn) episode, optionally training only
    on the groups whose rewards vary most (StarPO-S)."""

    type: Literal["episode"] = "episode"
    keep_groups_fraction: float = Field(1.0, gt=0, le=1)
    """StarPO-S: train on this fraction of each batch's groups, those with the largest
    reward std (1 keeps every group)."""


class StepAdvantage(StrictModel):
    """GiGPO: the episode's GRPO advantage plus a step-level one: turns of one group taken
    in the same state are compared by their discounted returns."""

    type: Literal["step"] = "step"
    weight: float = Field(1.0, ge=0)
    """Weight of the step-level advantage added to the episode one."""
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount of later turns' rewards in a turn's return."""
    scale: bool = True
    """Divide by the std within each group (of episodes, and of steps in one state)."""


class CriticConfig(StrictModel):
    """The value model of `advantage: gae`: the policy's transformer (or another one) with
    a one-output head, trained in the trainer beside the policy, on the same backend and
    ranks, with its own AdamW; checkpointed and resumed with the policy (`critic/`)."""

    model_path: Path | None = None
    """Model the critic starts from; the policy's own (trainer.model_path) when unset. Its
    head is new and starts at 0 (every value 0 before the first update)."""
    learning_rate: float | None = Field(None, gt=0)
    """The critic's AdamW rate; trainer.optimizer.learning_rate when unset (critics often take a
    few times the policy's). The trainer's lr_schedule applies to it too."""
    value_clip: float | None = Field(0.2, gt=0)
    """PPO's value clipping: an update moves a value at most this far from where the
    step began (in reward units); unset is a plain squared error."""
    max_grad_norm: float | None = Field(None, gt=0)
    """Gradient norm clip of the critic's updates; trainer.optimizer.max_grad_norm when unset."""


class GAEAdvantage(StrictModel):
    """PPO's advantages: generalised advantage estimation over the generated tokens with a
    learned value model (`critic`), whitened over the batch; the critic is trained on the
    lambda-returns by the same minibatches and epochs as the policy."""

    type: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per generated token (1: the usual choice for a reward at the end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 one-step TD."""
    whiten: bool = True
    """Normalise the advantages over the batch's generated tokens (mean 0, std 1)."""
    critic: CriticConfig = CriticConfig()
    """The value model."""


class OnPolicyDistillAdvantage(StrictModel):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025): the
    student samples as in RL, a teacher rollout-server scores the sampled tokens
    (distill.teacher_model_path or endpoints.teacher_servers), and each generated token's
    advantage is kl_coef x (teacher logprob - student logprob), the negative per-token
    reverse KL, plus reward_weight x the task reward's GRPO advantage. Needs rl.temperature
    1 (both distributions as the models give them); teacher and student share a tokenizer."""

    type: Literal["on_policy_distill"] = "on_policy_distill"
    kl_coef: float = Field(1.0, gt=0)
    """Weight of the per-token teacher-minus-student logprob in each token's advantage."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task reward's group advantage (GRPO) added to every generated token's;
    0 distils alone."""


def _default_type(default: str) -> Callable[[Any], str | None]:
    def discriminate(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", None)

    return discriminate


AdvantageConfig = Annotated[
    Annotated[GRPOAdvantage, Tag("grpo")]
    | Annotated[DrGRPOAdvantage, Tag("dr_grpo")]
    | Annotated[RLOOAdvantage, Tag("rloo")]
    | Annotated[LitePPOAdvantage, Tag("lite_ppo")]
    | Annotated[ReinforcePlusPlusAdvantage, Tag("reinforce_plus_plus")]
    | Annotated[EpisodeAdvantage, Tag("episode")]
    | Annotated[StepAdvantage, Tag("step")]
    | Annotated[GAEAdvantage, Tag("gae")]
    | Annotated[OnPolicyDistillAdvantage, Tag("on_policy_distill")],
    Discriminator(_default_type("grpo")),
    TYPE_SHORTHAND,
]

# ---------------------------------------------------------------- policy losses


class PPOClipLoss(StrictModel):
    """PPO's clipped surrogate per token, with clip-higher and an optional dual clip."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the ratio pi / pi_old: 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip of the ratio: 1 + clip_high (clip-higher when above clip_low). The clip
    binds only from a step's second update on (`trainer.batching.minibatches_per_step`,
    `trainer.batching.epochs_per_step`): in the first, pi is the proximal policy itself."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip c for negative advantages: the surrogate is bounded below by c * A, so a
    huge ratio on a bad token cannot dominate (3 is usual); unset is off."""


class GSPOLoss(StrictModel):
    """GSPO: one ratio per sequence (the geometric mean of its token ratios), clipped per
    sequence; use with `trainer.algorithm.aggregation: seq_mean_token_mean`."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1)
    """Lower clip of the sequence ratio (the paper's 3e-4: sequence ratios stay near 1)."""
    clip_high: float = Field(4e-4, ge=0)
    """Upper clip of the sequence ratio (the paper's 4e-4)."""


class CISPOLoss(StrictModel):
    """CISPO: the clipped, detached importance ratio times the advantage and the
    log-likelihood gradient; no token's gradient is clipped away."""

    type: Literal["cispo"] = "cispo"
    clip_low: float | None = Field(None, ge=0, lt=1)
    """Lower bound 1 - clip_low of the weight; unset (the paper's choice) is none."""
    clip_high: float = Field(0.28, ge=0)
    """Upper bound 1 + clip_high of the weight."""


class TOPRLoss(StrictModel):
    """TOPR: plain REINFORCE on positive-advantage sequences, the ratio truncated to
    [0, 1] on negative ones."""

    type: Literal["topr"] = "topr"


class RaftPlusPlusLoss(StrictModel):
    """RAFT++: PPO's clipped surrogate on the accepted samples only (advantage above 0)."""

    type: Literal["raft_plus_plus"] = "raft_plus_plus"
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the ratio."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip of the ratio."""


class ReinforceLoss(StrictModel):
    """REINFORCE: -A log pi per token."""

    type: Literal["reinforce"] = "reinforce"


PolicyLossConfig = Annotated[
    Annotated[PPOClipLoss, Tag("ppo_clip")]
    | Annotated[GSPOLoss, Tag("gspo")]
    | Annotated[CISPOLoss, Tag("cispo")]
    | Annotated[TOPRLoss, Tag("topr")]
    | Annotated[RaftPlusPlusLoss, Tag("raft_plus_plus")]
    | Annotated[ReinforceLoss, Tag("reinforce")],
    Discriminator(_default_type("ppo_clip")),
    TYPE_SHORTHAND,
]

# ---------------------------------------------------------------- off-policy corrections


class NoCorrection(StrictModel):
    """Plain PPO: the ratio against the behaviour (engine) logprobs, no weights."""

    type: Literal["none"] = "none"


class TISCorrection(StrictModel):
    """Truncated importance sampling: the ratio against the proximal policy, each token
    weighted by min(pi_prox / mu, cap)."""

    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0)
    """Truncation of the importance weight."""


class DecoupledCorrection(StrictModel):
    """AReaL's decoupled PPO: the ratio against the proximal policy, times the weight
    pi_prox / mu; tokens whose weight exceeds `cap` are left out."""

    type: Literal["decoupled"] = "decoupled"
    cap: float = Field(5.0, gt=0)
    """Tokens with a larger weight are masked out."""


class MISCorrection(StrictModel):
    """Masked importance sampling: the ratio against the proximal policy, no weights, and
    tokens whose weight pi_prox / mu is outside [low, high] masked out."""

    type: Literal["mis"] = "mis"
    low: float = Field(0.5, ge=0)
    """Smallest weight kept."""
    high: float = Field(2.0, gt=0)
    """Largest weight kept."""


CorrectionConfig = Annotated[
    Annotated[NoCorrection, Tag("none")]
    | Annotated[TISCorrection, Tag("tis")]
    | Annotated[DecoupledCorrection, Tag("decoupled")]
    | Annotated[MISCorrection, Tag("mis")],
    Discriminator(_default_type("tis")),
    TYPE_SHORTHAND,
]


class KLConfig(StrictModel):
    """A KL penalty to the initial model, as a loss term or in the reward."""

    coef: float = Field(0.0, ge=0)
    """Weight of the KL term; 0 loads no reference model."""
    estimator: KLEstimator = "k3"
    """Per-token estimator of KL(pi || ref) with d = log ref - log pi: `k1` = -d, `k2` =
    d^2 / 2, `k3` = exp(d) - d - 1 (unbiased and never negative)."""
    in_reward: bool = False
    """Fold the penalty into the reward instead of the loss: every generated token's
    reward loses coef x the estimate (of the proximal policy, before the step's first
    update; no gradient), and the advantages are taken from those token rewards. For
    `advantage: gae` (PPO's usual KL) and `reinforce_plus_plus` (each token's return to
    go, whitened over the batch's tokens), as in those papers."""


class OverlongConfig(StrictModel):
    """DAPO's handling of responses the engine cut at its length limit."""

    mask_truncated: bool = False
    """Leave responses cut at the limit (finish reason `length`) out of the loss, so a
    cut-off answer is not taught as a wrong one (DAPO's overlong filtering); they still
    count in their group's advantages."""
    penalty_tokens: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: a response within this many generated tokens of
    `max_tokens` loses reward linearly, down to -1 at the limit; unset is off."""
    max_tokens: int | None = Field(None, ge=1)
    """The limit the penalty counts to (generated tokens of the trajectory); the run's
    orchestrator.max_new_tokens when unset."""

    @model_validator(mode="after")
    def _penalty_fits(self) -> OverlongConfig:
        if self.penalty_tokens and self.max_tokens and self.penalty_tokens > self.max_tokens:
            raise ValueError(
                f"trainer.algorithm.overlong.penalty_tokens={self.penalty_tokens} is more than "
                f"max_tokens={self.max_tokens}"
            )
        return self


def settings_of(section: StrictModel) -> dict[str, Any]:
    """A section's fields other than `type`: the keyword arguments of its table entry."""
    return {k: v for k, v in section.model_dump().items() if k != "type"}
