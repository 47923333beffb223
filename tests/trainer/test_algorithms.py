"""Advantages and losses against numbers worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rollwire.trainer.math.algorithms import (
    ADVANTAGE_ESTIMATORS,
    RunningMoments,
    discounted_returns,
    distill_advantages,
    dr_grpo,
    final_token_rewards,
    gae,
    group_advantages,
    grpo,
    high_variance_groups,
    lite_ppo,
    lr_factor,
    normalized_rewards,
    overlong_penalty,
    reinforce_plus_plus,
    rloo,
    step_advantages,
    token_entropy,
    token_logprobs,
)
from rollwire.trainer.math.losses import masked_mean

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


def test_every_advantage_estimator_by_hand() -> None:
    # Two groups of three: [1, 0, 0] (mean 1/3, std sqrt(2)/3) and [2, 2, 5] (mean 3, std sqrt 2).
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    r2 = math.sqrt(2)
    assert grpo(rewards=rewards, group_size=3).tolist() == pytest.approx(
        [2 / r2, -1 / r2, -1 / r2, -1 / r2, -1 / r2, 2 / r2], abs=1e-5
    )
    assert dr_grpo(rewards=rewards, group_size=3).tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -1, -1, 2]
    )
    # RLOO: r_i minus the mean of the other two: 1 - 0, 0 - 0.5, ...; 2 - 3.5, 5 - 2.
    assert rloo(rewards=rewards, group_size=3).tolist() == pytest.approx(
        [1.0, -0.5, -0.5, -1.5, -1.5, 3.0]
    )
    with pytest.raises(ValueError, match="at least two"):
        rloo(rewards=rewards, group_size=1)
    # Lite PPO: group-centred, over the batch std (mean 5/3 over all six rewards).
    batch_std = math.sqrt(sum((r - 5 / 3) ** 2 for r in rewards.tolist()) / 6)
    centred = [2 / 3, -1 / 3, -1 / 3, -1, -1, 2]
    assert lite_ppo(rewards=rewards, group_size=3).tolist() == pytest.approx(
        [c / batch_std for c in centred], abs=1e-5
    )
    # REINFORCE++: the batch's mean and std; its group baseline: group-centred, then the
    # std of those centred values (mean 0): sqrt((4/9 + 1/9 + 1/9 + 1 + 1 + 4) / 6).
    assert reinforce_plus_plus(rewards=rewards, group_size=3).tolist() == pytest.approx(
        [(r - 5 / 3) / batch_std for r in rewards.tolist()], abs=1e-5
    )
    centred_std = math.sqrt((4 / 9 + 1 / 9 + 1 / 9 + 1 + 1 + 4) / 6)
    grouped = reinforce_plus_plus(rewards=rewards, group_size=3, baseline="group")
    assert grouped.tolist() == pytest.approx([c / centred_std for c in centred], abs=1e-5)
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "lite_ppo",
        "reinforce_plus_plus",
    }


def test_starpo_s_keeps_the_groups_whose_rewards_vary_most() -> None:
    # Stds: group 0 [1, 1] -> 0, group 1 [0, 1] -> 0.5, group 2 [0, 4] -> 2, group 3 -> 0.5.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 4.0, 1.0, 0.0])
    keep = high_variance_groups(rewards, 2, 0.5)
    assert keep.tolist() == [False, False, True, True, True, True, False, False]  # tie: earlier
    assert high_variance_groups(rewards, 2, 0.1).tolist() == [False] * 4 + [True] * 2 + [False] * 2


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
    # Decay from the start, the ramp multiplying it (the warm-up's shape): over 10 updates
    # with a 4-update ramp, update k runs at min(1, (k + 1) / 4) x (1 - k / 10).
    start = [lr_factor(s, 10, "linear", 4, 0.0, "start") for s in (0, 1, 3, 5, 9, 10)]
    assert start == pytest.approx([0.25, 0.5 * 0.9, 0.7, 0.5, 0.1, 0.0])


@pytest.mark.parametrize("name", ["algorithms", "losses"])
def test_algorithms_import_no_transport(name: str) -> None:
    """import-linter cannot forbid a subpackage of torch, so read the imports directly."""
    import ast
    import importlib

    module = importlib.import_module(f"rollwire.trainer.math.{name}")
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported, "the module imports something; the walk must find it"
    # The one module of the services they read: the names the config validates.
    assert not {
        name
        for name in imported
        if name.startswith(("torch.distributed", "grpc", "zmq", "rollwire.services"))
        and name != "rollwire.services.core.config.names"
    }


def test_final_token_rewards_sit_on_each_last_generated_token() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    out = final_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]]


def test_gae_by_hand() -> None:
    # Prompt token, then three actions; reward 1 at the end, gamma 1, lambda 0.5:
    # d3 = 1 - 0.8 = 0.2, d2 = 0.8 - 0.6 = 0.2, d1 = 0.6 - 0.5 = 0.1;
    # A3 = 0.2, A2 = 0.2 + 0.5 * 0.2 = 0.3, A1 = 0.1 + 0.5 * 0.3 = 0.25; R = A + V.
    advantages, returns = gae(
        token_rewards=torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
        values=torch.tensor([[9.0, 0.5, 0.6, 0.8]]),
        mask=torch.tensor([[0, 1, 1, 1]]),
        gamma=1.0,
        lam=0.5,
    )
    assert advantages.tolist()[0] == pytest.approx([0.0, 0.25, 0.3, 0.2])
    assert returns.tolist()[0] == pytest.approx([0.0, 0.75, 0.9, 1.0])
    # A tool's token between two actions is skipped, not discounted: with lambda 1 the
    # return is the Monte-Carlo one, 0.9 * 2 = 1.8, and A0 = 1.8 - 0.5.
    advantages, returns = gae(
        token_rewards=torch.tensor([[0.0, 0.0, 2.0]]),
        values=torch.tensor([[0.5, 7.0, 1.0]]),
        mask=torch.tensor([[1, 0, 1]]),
        gamma=0.9,
        lam=1.0,
    )
    assert advantages.tolist()[0] == pytest.approx([1.3, 0.0, 1.0])
    assert returns.tolist()[0] == pytest.approx([1.8, 0.0, 2.0])
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        gae(token_rewards=torch.zeros(1, 3), values=torch.zeros(1, 2), mask=torch.ones(1, 3))


def test_overlong_penalty_by_hand() -> None:
    # Limit 10, buffer 4: free up to 6 tokens, then -1/4 a token, -1 at 10 and beyond.
    lengths = torch.tensor([3, 6, 7, 9, 10, 12])
    penalty = overlong_penalty(lengths=lengths, max_tokens=10, buffer_tokens=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(lengths=lengths, max_tokens=3, buffer_tokens=4)


def test_running_moments_merge_batches_like_one() -> None:
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 3.0]))
    assert (moments.mean, moments.std) == pytest.approx((2.0, 1.0))
    moments.update(torch.tensor([5.0, 7.0, 9.0]))
    everything = torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0], dtype=torch.float64)
    assert moments.count == 5
    assert moments.mean == pytest.approx(5.0)
    assert moments.std == pytest.approx(float(everything.std(unbiased=False)))
    again = RunningMoments()
    again.load_state_dict(moments.state_dict())
    assert (again.count, again.mean, again.std) == (moments.count, moments.mean, moments.std)
    assert normalized_rewards(torch.tensor([2.0, 4.0]), 3.0, 1.0).tolist() == pytest.approx(
        [-1.0, 1.0], abs=1e-5
    )


def test_distill_advantages_by_hand() -> None:
    # Teacher minus student on sampled tokens, times kl_coef; 0 off the mask. Token 2:
    # the teacher finds it likelier (-0.5 vs -2.0): +1.5 x 2; token 3 less likely: -1 x 2.
    advantages = distill_advantages(
        teacher_logprobs=torch.tensor([[0.0, -0.5, -3.0, -9.0]]),
        student_logprobs=torch.tensor([[0.0, -2.0, -2.0, -1.0]]),
        mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
        kl_coef=2.0,
    )
    assert advantages.tolist() == [[0.0, 3.0, -2.0, 0.0]]
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        distill_advantages(
            teacher_logprobs=torch.zeros(1, 3),
            student_logprobs=torch.zeros(1, 4),
            mask=torch.zeros(1, 4),
        )
