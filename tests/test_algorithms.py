"""Advantages and losses against numbers worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rollwire.trainer.algorithms import (
    discounted_returns,
    group_advantages,
    kl_k3,
    lr_factor,
    masked_mean,
    policy_loss,
    step_advantages,
    token_entropy,
    token_logprobs,
)

ln = math.log


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 0.0, 0.0, 1.0])
    # Group 1: mean 0.5, std 0.5 -> +-1. Group 2: all equal -> 0.
    # Group 3: mean 1, population std sqrt((4+1+1+0)/4) = sqrt(1.5).
    s = math.sqrt(1.5)
    expected = [1, -1, -1, 1, 0, 0, 0, 0, 2 / s, -1 / s, -1 / s, 0]
    assert group_advantages(rewards, 4).tolist() == pytest.approx(expected, abs=1e-5)
    unscaled = group_advantages(rewards, 4, scale=False)
    assert unscaled.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 2, -1, -1, 0])
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)


def test_discounted_returns_by_hand() -> None:
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, -1.0], 1.0) == [0.0, -1.0]
    assert discounted_returns([], 0.9) == []


def test_step_advantages_by_hand() -> None:
    # One group of three episodes from the same seed. All start in state "a".
    # Episodes 0 and 1 then both reach "b"; episode 2 reaches "c" (no peer there).
    keys = [["a", "b"], ["a", "b"], ["a", "c"]]
    rewards = [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    episode = torch.tensor([1.0, -0.5, -0.5])
    out = step_advantages(episode, keys, rewards, group_size=3, gamma=0.5, weight=2.0)
    # Returns: ep0 [0.5, 1], ep1 [0, 0], ep2 [0, 0].
    # State "a": values [0.5, 0, 0], mean 1/6, population std sqrt(1/18).
    std_a = math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 3)
    a0, a_other = (0.5 - 1 / 6) / std_a, (-1 / 6) / std_a
    # State "b": values [1, 0] -> +1, -1. State "c": alone -> 0.
    assert out[0].tolist() == pytest.approx([1 + 2 * a0, 1 + 2 * 1.0], abs=1e-4)
    assert out[1].tolist() == pytest.approx([-0.5 + 2 * a_other, -0.5 - 2.0], abs=1e-4)
    assert out[2].tolist() == pytest.approx([-0.5 + 2 * a_other, -0.5], abs=1e-4)
    # Groups are separate: the same key in another group is no peer.
    two_groups = step_advantages(
        torch.zeros(2), [["s"], ["s"]], [[1.0], [0.0]], group_size=1, weight=1.0
    )
    assert [t.tolist() for t in two_groups] == [[0.0], [0.0]]
    with pytest.raises(ValueError, match="2 turn keys but 1 step rewards"):
        step_advantages(torch.zeros(1), [["a", "b"]], [[1.0]], group_size=1)
    with pytest.raises(ValueError, match="do not form groups of 2"):
        step_advantages(torch.zeros(3), [[]] * 3, [[]] * 3, group_size=2)


def tokens(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


MASK = torch.tensor([[0, 1, 1]])


def test_plain_ppo_clipping_positive_advantage() -> None:
    behaviour = tokens(0, ln(0.5), ln(0.5))
    current = tokens(ln(0.9), ln(0.6), ln(0.3)).requires_grad_()
    # ratios 1.2 and 0.6; A = +1; clip range [0.8, 1.28]
    # token 2: min(1.2, 1.2) = 1.2; token 3: min(0.6, 0.8) = 0.6 -> loss -(1.2 + 0.6)/2
    out = policy_loss(current, behaviour, behaviour, torch.tensor([1.0]), MASK, correction="none")
    assert out.loss.item() == pytest.approx(-0.9)
    out.loss.backward()
    # d/dlogp of -ratio*A/2 = -ratio/2 for unclipped tokens; token 1 is masked.
    assert current.grad.tolist()[0] == pytest.approx([0.0, -0.6, -0.3])
    assert out.metrics["ratio_mean"] == pytest.approx(0.9)
    assert out.metrics["clip_frac_high"] == 0.0 and out.metrics["clip_frac_low"] == 0.0


def test_plain_ppo_clipping_negative_advantage_and_clip_higher() -> None:
    behaviour = tokens(0, ln(0.5), ln(0.5))
    current = tokens(0, ln(0.6), ln(0.3)).requires_grad_()
    # A = -1: token 2: min(-1.2, -1.2) = -1.2; token 3: min(-0.6, -0.8) = -0.8 (clipped)
    out = policy_loss(current, behaviour, behaviour, torch.tensor([-1.0]), MASK, correction="none")
    assert out.loss.item() == pytest.approx((1.2 + 0.8) / 2)
    out.loss.backward()
    assert current.grad.tolist()[0] == pytest.approx(
        [0.0, 0.6, 0.0]
    )  # clipped token gets no gradient
    assert out.metrics["clip_frac_low"] == pytest.approx(0.5)
    # Clip-higher: ratio 1.5 with A = +1 is cut at 1 + 0.28, not 1 + 0.2.
    high = tokens(0, ln(0.75), ln(0.5))
    out = policy_loss(high, behaviour, behaviour, torch.tensor([1.0]), MASK, correction="none")
    assert out.loss.item() == pytest.approx(-(1.28 + 1.0) / 2)
    assert out.metrics["clip_frac_high"] == pytest.approx(0.5)


def test_truncated_importance_sampling() -> None:
    proximal = tokens(0, ln(0.4), ln(0.5))
    behaviour = tokens(0, ln(0.5), ln(0.25))
    current = proximal.clone().requires_grad_()
    # weights pi_prox/mu = 0.8 and 2.0, truncated at 1.5; ratio 1; A = 1
    out = policy_loss(
        current, proximal, behaviour, torch.tensor([1.0]), MASK, correction="tis", tis_cap=1.5
    )
    assert out.loss.item() == pytest.approx(-(0.8 + 1.5) / 2)
    out.loss.backward()
    assert current.grad.tolist()[0] == pytest.approx([0.0, -0.4, -0.75])
    assert out.metrics["is_weight_max"] == pytest.approx(2.0)
    assert out.metrics["is_truncated_frac"] == pytest.approx(0.5)


def test_kl_k3_by_hand_and_penalty() -> None:
    # policy 0.5, reference 0.25: d = ln 0.5; exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert float(kl_k3(torch.tensor(ln(0.5)), torch.tensor(ln(0.25)))) == pytest.approx(ln(2) - 0.5)
    assert float(kl_k3(torch.tensor(-1.3), torch.tensor(-1.3))) == 0.0
    behaviour = tokens(0, ln(0.5), ln(0.5))
    reference = tokens(0, ln(0.25), ln(0.5))
    out = policy_loss(
        behaviour,
        behaviour,
        behaviour,
        torch.tensor([0.0]),
        MASK,
        correction="none",
        reference_logprobs=reference,
        kl_coef=0.1,
    )
    assert out.loss.item() == pytest.approx(0.1 * (ln(2) - 0.5) / 2)
    assert out.metrics["kl"] == pytest.approx((ln(2) - 0.5) / 2)


def test_masked_mean_and_token_logprobs() -> None:
    assert float(masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))) == 1.5
    assert float(masked_mean(torch.tensor([[1.0]]), torch.tensor([[0]]))) == 0.0
    logits = torch.tensor([[[0.0, ln(3.0)]]])  # probabilities 1/4, 3/4
    assert float(token_logprobs(logits, torch.tensor([[1]]))) == pytest.approx(ln(0.75))
    # Temperature 2 halves the logits: probabilities 1/(1+sqrt 3), sqrt 3/(1+sqrt 3)
    assert float(token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)) == pytest.approx(
        -ln(1 + math.sqrt(3))
    )


def test_token_entropy_by_hand() -> None:
    # Probabilities 1/4, 3/4: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3.
    logits = torch.tensor([[[0.0, ln(3.0)], [5.0, 5.0]]])
    entropy = token_entropy(logits)
    assert entropy.shape == (1, 2)
    assert entropy.tolist()[0] == pytest.approx([ln(4) - 0.75 * ln(3), ln(2)])
    # Temperature 2: probabilities a = 1/(1+sqrt 3) and b = sqrt 3/(1+sqrt 3), so
    # H = -(a ln a + b ln b) = ln(1 + sqrt 3) - b * ln(3) / 2.
    b = math.sqrt(3) / (1 + math.sqrt(3))
    assert float(token_entropy(logits, temperature=2.0)[0, 0]) == pytest.approx(
        ln(1 + math.sqrt(3)) - b * ln(3) / 2
    )
    # bfloat16 logits are upcast: the same answer, in float32.
    assert token_entropy(logits.bfloat16()).dtype == torch.float32
    assert float(token_entropy(torch.zeros(1, 1, 4).bfloat16())[0, 0]) == pytest.approx(ln(4))


def test_lr_factor_by_hand() -> None:
    assert [lr_factor(s, 10) for s in (0, 5, 1000)] == [1.0, 1.0, 1.0]
    # Warm-up over 4 updates: (k + 1) / 4, then the base rate.
    assert [lr_factor(s, 10, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    # Linear over 10 updates, 2 of warm-up, down to 0.1: the decay spans updates 2..10.
    linear = [lr_factor(s, 10, "linear", 2, 0.1) for s in (0, 1, 2, 6, 9, 10, 20)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5, 0.1 + 0.9 / 8, 0.1, 0.1])
    # Cosine over 8 updates to 0: at a quarter of the way 0.5 (1 + cos(pi / 4)).
    cosine = [lr_factor(s, 8, "cosine") for s in (0, 2, 4, 8, 9)]
    assert cosine == pytest.approx([1.0, 0.5 + math.sqrt(2) / 4, 0.5, 0.0, 0.0])
    # A run no longer than its warm-up: the decay has no span, and ends at once.
    assert lr_factor(3, 3, "linear", 3, 0.2) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor(0, 10, "step")  # type: ignore[arg-type]


def test_unknown_correction_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        policy_loss(
            tokens(0, 0, 0),
            tokens(0, 0, 0),
            tokens(0, 0, 0),
            torch.tensor([1.0]),
            MASK,
            correction="ppo",
        )  # type: ignore[arg-type]


def test_algorithms_import_no_transport() -> None:
    """import-linter cannot forbid a subpackage of torch, so read the imports directly."""
    import ast

    import rollwire.trainer.algorithms as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported, "the module imports something; the walk must find it"
    assert not {
        name
        for name in imported
        if name.startswith(("torch.distributed", "grpc", "zmq", "rollwire.services"))
    }
