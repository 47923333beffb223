"""Policy losses, corrections, aggregation and KL estimators (trainer/math/losses.py) against
numbers worked out by hand: values and gradients on one or two sequences of three
tokens, the first of them a prompt token (masked out)."""

from __future__ import annotations

import math

import pytest
import torch

from rollwire.trainer.math.losses import (
    CORRECTIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    aggregate,
    kl_estimate,
    masked_mean,
    policy_objective,
    topk_forward_kl,
    topk_reverse_kl,
    value_loss,
)

ln = math.log
MASK = torch.tensor([[0, 1, 1]])
BEHAVIOUR = torch.tensor([[0, ln(0.5), ln(0.5)]], dtype=torch.float64)


def tokens(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def run(current: torch.Tensor, advantage: float, **settings) -> tuple[float, list[float], dict]:
    """(loss, gradient of the loss by the current logprobs, metrics) of one sequence."""
    current = current.clone().requires_grad_()
    settings = {"correction": "none", **settings}
    out = policy_objective(
        logprobs=current,
        proximal_logprobs=settings.pop("proximal", BEHAVIOUR),
        behaviour_logprobs=settings.pop("behaviour", BEHAVIOUR),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        mask=MASK,
        **settings,
    )
    loss = out.numerator / out.denominator
    loss.backward()
    return float(loss.detach()), current.grad.tolist()[0], out.metrics


# ---------------------------------------------------------------- ppo_clip


def test_ppo_clip_positive_advantage() -> None:
    # ratios 1.2 and 0.6, A = +1, clip range [0.8, 1.28]: min(1.2, 1.2) and min(0.6, 0.8).
    loss, grad, metrics = run(tokens(ln(0.9), ln(0.6), ln(0.3)), 1.0)
    assert loss == pytest.approx(-(1.2 + 0.6) / 2)
    # d/dlogp of -ratio * A / 2 = -ratio / 2 on unclipped tokens; token 1 is the prompt.
    assert grad == pytest.approx([0.0, -0.6, -0.3])
    assert metrics["ratio_mean"] == pytest.approx(0.9)
    assert metrics["clip_frac_high"] == 0.0 and metrics["clip_frac_low"] == 0.0


def test_ppo_clip_negative_advantage_and_clip_higher() -> None:
    # A = -1: min(-1.2, -1.2) = -1.2 and min(-0.6, -0.8) = -0.8, clipped: no gradient.
    loss, grad, metrics = run(tokens(0, ln(0.6), ln(0.3)), -1.0)
    assert loss == pytest.approx((1.2 + 0.8) / 2)
    assert grad == pytest.approx([0.0, 0.6, 0.0])
    assert metrics["clip_frac_low"] == pytest.approx(0.5)
    # Clip-higher: ratio 1.5 with A = +1 is cut at 1 + 0.28, not 1 + 0.2.
    loss, _, metrics = run(tokens(0, ln(0.75), ln(0.5)), 1.0)
    assert loss == pytest.approx(-(1.28 + 1.0) / 2)
    assert metrics["clip_frac_high"] == pytest.approx(0.5)


def test_ppo_dual_clip_bounds_a_huge_ratio_on_a_negative_advantage() -> None:
    # Ratios 5 and 1, A = -1: min(-5, -1.28) = -5, raised to the floor 3 * -1 = -3; the
    # second token's surrogate is -1. Loss -(-3 - 1) / 2 = 2; the floor has no gradient.
    current = tokens(0, ln(2.5), ln(0.5))
    loss, grad, metrics = run(current, -1.0, loss_settings={"dual_clip": 3.0})
    assert loss == pytest.approx(2.0)
    assert grad == pytest.approx([0.0, 0.0, 0.5])
    assert metrics["clip_frac_low"] == pytest.approx(0.5)
    assert run(current, -1.0)[0] == pytest.approx((5 + 1) / 2)  # without it


# ---------------------------------------------------------------- corrections

PROXIMAL = tokens(0, ln(0.4), ln(0.5))
STALE = tokens(0, ln(0.5), ln(0.25))  # behaviour: weights pi_prox / mu = 0.8 and 2.0


def test_tis_truncates_the_weight() -> None:
    loss, grad, metrics = run(
        PROXIMAL,
        1.0,
        correction="tis",
        correction_settings={"cap": 1.5},
        proximal=PROXIMAL,
        behaviour=STALE,
    )
    # ratio 1 against the proximal policy; weights 0.8 and min(2.0, 1.5).
    assert loss == pytest.approx(-(0.8 + 1.5) / 2)
    assert grad == pytest.approx([0.0, -0.4, -0.75])
    assert metrics["is_weight_max"] == pytest.approx(2.0)
    assert metrics["is_truncated_frac"] == pytest.approx(0.5)
    assert metrics["is_masked_frac"] == 0.0


def test_decoupled_drops_tokens_over_the_cap_and_mis_keeps_a_range_unweighted() -> None:
    loss, grad, metrics = run(
        PROXIMAL,
        1.0,
        correction="decoupled",
        correction_settings={"cap": 1.5},
        proximal=PROXIMAL,
        behaviour=STALE,
    )
    # Weight 0.8 kept, 2.0 over the cap: masked out, still counted in the token mean.
    assert loss == pytest.approx(-0.8 / 2)
    assert grad == pytest.approx([0.0, -0.4, 0.0])
    assert metrics["is_masked_frac"] == pytest.approx(0.5)
    loss, grad, metrics = run(
        PROXIMAL,
        1.0,
        correction="mis",
        correction_settings={"low": 0.9, "high": 3.0},
        proximal=PROXIMAL,
        behaviour=STALE,
    )
    # 0.8 is below the range: masked; 2.0 is inside: kept with weight 1.
    assert loss == pytest.approx(-1.0 / 2)
    assert grad == pytest.approx([0.0, 0.0, -0.5])
    assert metrics["is_masked_frac"] == pytest.approx(0.5)


def test_decoupled_equals_ppo_clip_when_behaviour_is_the_proximal_policy() -> None:
    current = tokens(0, ln(0.7), ln(0.2))
    plain = run(current, -1.0, correction="none", proximal=PROXIMAL, behaviour=PROXIMAL)
    coupled = run(current, -1.0, correction="decoupled", proximal=PROXIMAL, behaviour=PROXIMAL)
    assert coupled[0] == pytest.approx(plain[0]) and coupled[1] == pytest.approx(plain[1])


# ---------------------------------------------------------------- other policy losses


def test_gspo_clips_one_geometric_mean_ratio_per_sequence() -> None:
    # Token ratios 1.2 and 0.6: the sequence ratio is sqrt(0.72), inside [0.8, 1.28].
    settings = {"loss": "gspo", "loss_settings": {"clip_low": 0.2, "clip_high": 0.28}}
    s = math.sqrt(0.72)
    loss, grad, metrics = run(
        tokens(0, ln(0.6), ln(0.3)), 1.0, aggregation="seq_mean_token_mean", **settings
    )
    assert loss == pytest.approx(-s)
    # d(-s)/dlogp_t = -s / 2 for each of the two tokens.
    assert grad == pytest.approx([0.0, -s / 2, -s / 2])
    assert metrics["ratio_mean"] == pytest.approx(s)
    # Ratios 1.5 and 1.5: the sequence ratio 1.5 is clipped at 1.28: no gradient at all.
    loss, grad, metrics = run(tokens(0, ln(0.75), ln(0.75)), 1.0, **settings)
    assert loss == pytest.approx(-1.28) and grad == pytest.approx([0.0, 0.0, 0.0])
    assert metrics["clip_frac_high"] == 1.0


def test_gspo_equals_ppo_clip_on_one_token_sequences() -> None:
    generator = torch.Generator().manual_seed(0)
    current = torch.randn(6, 1, generator=generator, dtype=torch.float64) * 0.3 - 1
    old = torch.randn(6, 1, generator=generator, dtype=torch.float64) * 0.3 - 1
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5], dtype=torch.float64)
    grads = []
    for loss in ("gspo", "ppo_clip"):
        logprobs = current.clone().requires_grad_()
        out = policy_objective(
            logprobs=logprobs,
            proximal_logprobs=old,
            behaviour_logprobs=old,
            advantages=advantages,
            mask=torch.ones(6, 1),
            loss=loss,
            loss_settings={"clip_low": 0.1, "clip_high": 0.2},
            correction="none",
        )
        (out.numerator / out.denominator).backward()
        grads.append((float(out.numerator.detach()), logprobs.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0])
    assert torch.allclose(grads[0][1], grads[1][1])


def test_cispo_keeps_every_tokens_gradient_under_a_clipped_weight() -> None:
    # Ratios 1.2 and 0.6 against mu; weights min(1.2, 1.1) = 1.1 and 0.6, detached.
    current = tokens(0, ln(0.6), ln(0.3))
    loss, grad, _ = run(current, 1.0, loss="cispo", loss_settings={"clip_high": 0.1})
    assert loss == pytest.approx(-(1.1 * ln(0.6) + 0.6 * ln(0.3)) / 2)
    assert grad == pytest.approx([0.0, -1.1 / 2, -0.6 / 2])
    # A lower bound lifts 0.6 to 0.7.
    _, grad, _ = run(current, 1.0, loss="cispo", loss_settings={"clip_high": 0.1, "clip_low": 0.3})
    assert grad == pytest.approx([0.0, -1.1 / 2, -0.7 / 2])


def test_topr_is_reinforce_on_positives_and_truncated_on_negatives() -> None:
    current = tokens(0, ln(0.6), ln(0.3))  # ratios 1.2 and 0.6
    loss, grad, _ = run(current, 1.0, loss="topr")
    assert loss == pytest.approx(-(ln(0.6) + ln(0.3)) / 2)
    assert grad == pytest.approx([0.0, -0.5, -0.5])  # no ratio at all
    loss, grad, _ = run(current, -1.0, loss="topr")
    # Weights min(1.2, 1) = 1 and 0.6: -(-1)(1 * logp2 + 0.6 * logp3) / 2.
    assert loss == pytest.approx((ln(0.6) + 0.6 * ln(0.3)) / 2)
    assert grad == pytest.approx([0.0, 0.5, 0.3])


def test_raft_plus_plus_learns_from_accepted_samples_only() -> None:
    current = torch.tensor([[0, ln(0.6), ln(0.3)], [0, ln(0.6), ln(0.3)]], dtype=torch.float64)
    logprobs = current.clone().requires_grad_()
    out = policy_objective(
        logprobs=logprobs,
        proximal_logprobs=BEHAVIOUR.expand(2, 3),
        behaviour_logprobs=BEHAVIOUR.expand(2, 3),
        advantages=torch.tensor([0.7, -0.7]),
        mask=MASK.expand(2, 3),
        loss="raft_plus_plus",
        correction="none",
    )
    loss = out.numerator / out.denominator
    loss.backward()
    # The accepted row: PPO with advantage 1 (ratios 1.2 and 0.6 -> min(0.6, 0.8) = 0.6);
    # the rejected row adds nothing; the token mean is over all four generated tokens.
    assert float(loss.detach()) == pytest.approx(-(1.2 + 0.6) / 4)
    assert logprobs.grad.flatten().tolist() == pytest.approx([0, -1.2 / 4, -0.6 / 4, 0, 0, 0])


def test_reinforce_is_minus_advantage_times_logprob() -> None:
    loss, grad, _ = run(tokens(0, ln(0.6), ln(0.3)), 2.0, loss="reinforce")
    assert loss == pytest.approx(-2.0 * (ln(0.6) + ln(0.3)) / 2)
    assert grad == pytest.approx([0.0, -1.0, -1.0])


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*gspo"):
        run(BEHAVIOUR, 1.0, loss="ppo")
    with pytest.raises(ValueError, match="unknown off-policy correction 'is'.*decoupled"):
        run(BEHAVIOUR, 1.0, correction="is")
    assert set(POLICY_LOSSES) == {
        "ppo_clip",
        "gspo",
        "cispo",
        "topr",
        "raft_plus_plus",
        "reinforce",
    }
    assert set(CORRECTIONS) == {"none", "tis", "decoupled", "mis"}


# ---------------------------------------------------------------- aggregation, KL, entropy


def test_aggregations_by_hand_and_parts_add_up() -> None:
    values = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third has no tokens
    expected = {
        "token_mean": (7.0, 3.0),
        "seq_mean_token_sum": (7.0, 2.0),
        "seq_mean_token_mean": (1.5 + 4.0, 2.0),
        "constant": (7.0, 2.0 * 4),
    }
    for how, (numerator, denominator) in expected.items():
        total, count = aggregate(values, mask, how, constant=4.0)
        assert (float(total), count) == (pytest.approx(numerator), denominator), how
        # Split by rows: the parts' numerators and denominators add up to the whole's.
        parts = [aggregate(values[i : i + 1], mask[i : i + 1], how, 4.0) for i in range(3)]
        assert sum(float(n) for n, _ in parts) == pytest.approx(numerator)
        assert sum(d for _, d in parts) == denominator
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(values, mask, "sum")  # type: ignore[arg-type]
    assert float(masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))) == 1.5
    assert float(masked_mean(torch.tensor([[1.0]]), torch.tensor([[0]]))) == 0.0


def test_kl_estimators_by_hand_and_the_penalty() -> None:
    policy, reference = torch.tensor(ln(0.5)), torch.tensor(ln(0.25))
    # d = ln(0.25 / 0.5) = -ln 2.
    assert float(kl_estimate(policy, reference, "k1")) == pytest.approx(ln(2))
    assert float(kl_estimate(policy, reference, "k2")) == pytest.approx(ln(2) ** 2 / 2)
    assert float(kl_estimate(policy, reference, "k3")) == pytest.approx(0.5 + ln(2) - 1)
    assert float(kl_estimate(torch.tensor(-1.3), torch.tensor(-1.3))) == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(policy, reference, "k4")  # type: ignore[arg-type]
    reference = tokens(0, ln(0.25), ln(0.5))
    loss, _, metrics = run(BEHAVIOUR, 0.0, reference_logprobs=reference, kl_coef=0.1)
    assert loss == pytest.approx(0.1 * (ln(2) - 0.5) / 2)
    assert metrics["kl"] == pytest.approx((ln(2) - 0.5) / 2)


def test_entropy_bonus_lowers_the_loss_by_its_mean() -> None:
    entropy = tokens(0, 1.0, 3.0)
    loss, _, _ = run(BEHAVIOUR, 0.0, entropy=entropy, entropy_coef=0.01)
    assert loss == pytest.approx(-0.01 * (1.0 + 3.0) / 2)


def test_value_loss_clips_by_hand() -> None:
    # Token 0: (1 - 2)^2 = 1, clipped value 0.5 + 0.2 = 0.7 gives (0.7 - 2)^2 = 1.69:
    # the larger, so 0.845 and no gradient (the clamp is flat). Token 1: (0 - 0.4)^2 =
    # 0.16 against (0.3 - 0.4)^2 = 0.01: 0.08 with gradient v - R = -0.4. Token 2 masked.
    values = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    per_token, clipped = value_loss(
        values=values,
        old_values=torch.tensor([[0.5, 0.5, 0.0]]),
        returns=torch.tensor([[2.0, 0.4, 0.0]]),
        mask=torch.tensor([[1, 1, 0]]),
        clip=0.2,
    )
    assert per_token.tolist()[0] == pytest.approx([0.845, 0.08, 0.0])
    assert clipped.tolist() == [[True, False, False]]
    per_token.sum().backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, -0.4, 0.0])
    plain, clipped = value_loss(
        values=values.detach(),
        old_values=torch.zeros(1, 3),
        returns=torch.tensor([[2.0, 0.4, 0.0]]),
        mask=torch.tensor([[1, 1, 0]]),
        clip=None,
    )
    assert plain.tolist()[0] == pytest.approx([0.5, 0.08, 0.0]) and not clipped.any()


def test_preference_losses_by_hand() -> None:
    # h = (-2 - -3) - (-5 - -4) = 2.
    def run(name: str, **settings):
        chosen = torch.tensor([-2.0], requires_grad=True)
        rejected = torch.tensor([-5.0], requires_grad=True)
        out = PREFERENCE_LOSSES[name](
            chosen=chosen,
            rejected=rejected,
            reference_chosen=torch.tensor([-3.0]),
            reference_rejected=torch.tensor([-4.0]),
            chosen_tokens=torch.tensor([4.0]),
            rejected_tokens=torch.tensor([5.0]),
            **settings,
        )
        out.values.sum().backward()
        return (
            float(out.values.detach()),
            float(out.margin),
            float(chosen.grad),
            float(rejected.grad),
        )

    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # DPO: -log sigmoid(0.1 * 2), margin 0.2; d/dchosen = -beta sigmoid(-beta h).
    loss, margin, d_chosen, d_rejected = run("dpo", beta=0.1)
    assert loss == pytest.approx(math.log(1 + math.exp(-0.2)))
    assert margin == pytest.approx(0.2)
    assert d_chosen == pytest.approx(-0.1 * sigmoid(-0.2)) and d_rejected == pytest.approx(
        -d_chosen
    )
    # IPO: (2 - 1 / 0.2)^2 = 9, gradient 2 (h - 5) = -6.
    loss, margin, d_chosen, _ = run("ipo", beta=0.1)
    assert (loss, margin, d_chosen) == pytest.approx((9.0, 2.0, -6.0))
    # SimPO: 2 * (-2 / 4 - -5 / 5) = 1, minus gamma 0.5: -log sigmoid(0.5); no reference.
    loss, margin, d_chosen, _ = run("simpo", beta=2.0, gamma=0.5)
    assert loss == pytest.approx(math.log(1 + math.exp(-0.5))) and margin == pytest.approx(1.0)
    assert d_chosen == pytest.approx(-sigmoid(-0.5) * 2 / 4)


def test_topk_distillation_losses_by_hand() -> None:
    """The teacher keeps two tokens, at 0.6 and 0.2 (0.2 left for the rest); the
    student's vocabulary has three tokens, at 0.5, 0.25 and 0.25, so it gives the
    teacher's two 0.5 and 0.25 and the rest (token 1) 0.25."""
    teacher = torch.log(torch.tensor([[[0.6, 0.2]]]))
    top_ids = torch.tensor([[[0, 2]]])
    student = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))  # logits up to a constant
    forward = topk_forward_kl(logits=student, top_ids=top_ids, top_logprobs=teacher)
    expected = 0.6 * ln(0.6 / 0.5) + 0.2 * ln(0.2 / 0.25) + 0.2 * ln(0.2 / 0.25)
    assert forward.item() == pytest.approx(expected, abs=1e-5)
    reverse = topk_reverse_kl(logits=student, top_ids=top_ids, top_logprobs=teacher)
    expected = 0.5 * ln(0.5 / 0.6) + 0.25 * ln(0.25 / 0.2) + 0.25 * ln(0.25 / 0.2)
    assert reverse.item() == pytest.approx(expected, abs=1e-5)
    # Both vanish when the student is the teacher on the k tokens and on the rest.
    same = torch.log(torch.tensor([[[0.6, 0.2, 0.2]]]))
    for loss in (topk_forward_kl, topk_reverse_kl):
        value = loss(logits=same, top_ids=top_ids, top_logprobs=teacher).item()
        assert value == pytest.approx(0.0, abs=1e-5)
    # Mass moved off the teacher's tokens costs in both (the rest bucket).
    away = torch.log(torch.tensor([[[0.06, 0.92, 0.02]]]))
    assert topk_reverse_kl(logits=away, top_ids=top_ids, top_logprobs=teacher).item() > 1.0
    with pytest.raises(ValueError, match="must be \\[B, T, V\\]"):
        topk_forward_kl(logits=student[0], top_ids=top_ids, top_logprobs=teacher)
