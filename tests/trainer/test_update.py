"""The trainer step on the local backend: micro-batches, minibatches and epochs,
precision, gradient checkpointing, the LR schedule and its checkpoint."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from rollwire.services.core.config import LRScheduleConfig, RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import (
    TokenBatch,
    collate,
    micro_batches,
    pack_by_tokens,
    packed_attention,
    per_token_advantages,
    split_rows,
    supervised_batch,
)
from rollwire.trainer.learner import Learner
from rollwire.trainer.math.algorithms import token_entropy
from rollwire.trainer.pipelines.steps import SupervisedStep
from rollwire.trainer.rl.policy import Policy
from rollwire.trainer.rl.update import average
from tests.helpers.trajectories import PROMPT, RESPONSES, REWARDS, group


def make_policy(path, **settings) -> Policy:
    return Policy(path, TrainerConfig(**settings), RLSection(group_size=4, max_steps=4))


def make_supervised(path, **settings) -> SupervisedStep:
    return SupervisedStep(Learner(path, TrainerConfig(**settings), total_updates=4))


def advantaged_batch(policy: Policy) -> TokenBatch:
    trajectories = group()
    batch = collate(trajectories, policy.learner.pad_token_id)
    batch.advantages = per_token_advantages(
        trajectories, torch.tensor([1.0, -1.0, 1.0, -1.0]), None, batch.mask.shape[1]
    )
    return batch


def gradients(policy: Policy, parts: list[TokenBatch]) -> dict[str, torch.Tensor]:
    policy.learner.model.zero_grad(set_to_none=True)
    policy.step.updater.accumulate(parts, trainer_version=0)
    return {name: p.grad.clone() for name, p in policy.learner.model.named_parameters()}


def test_split_rows_and_pack_by_tokens_by_hand() -> None:
    assert split_rows(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_rows(4, 1) == [[0, 1, 2, 3]]
    assert split_rows(2, 3) == [[0], [1]]  # fewer rows than parts: fewer parts
    # Lengths 5, 9, 3, 9, 20 and 18 tokens: longest first, 9 + 9 = 18 fits, a third
    # row would make 27; 5 and 3 pad to 10; 20 is over the budget and goes alone.
    assert pack_by_tokens([5, 9, 3, 9, 20], 18) == [[4], [1, 3], [0, 2]]
    assert pack_by_tokens([4, 4, 4], 100) == [[0, 1, 2]]
    # Two prompts' rows, 0/2/4 and 1/3/5, in 36 tokens. Longest first spreads each
    # prompt over three passes. Kept together, prompt 1's run (its longest row 13) goes
    # first, 13 and 9 fill a pass (a third row would pad to 39), 8 starts the next one and
    # prompt 0's 12 and 11 join it (3 x 12 = 36), 10 is left: each prompt in two passes.
    lengths, runs = [12, 13, 10, 9, 11, 8], [[0, 2, 4], [1, 3, 5]]
    assert pack_by_tokens(lengths, 36) == [[1, 0], [4, 2, 3], [5]]
    assert pack_by_tokens(lengths, 36, runs) == [[1, 3], [5, 0, 4], [2]]


def test_micro_batches_within_the_token_budget_give_the_one_batch_gradient(
    tiny_model_path,
) -> None:
    policy = make_policy(tiny_model_path, max_tokens_per_micro_batch=24)
    batch = advantaged_batch(policy)
    parts = policy.step.updater.parts(batch)
    # Lengths 11, 10, 13 and 9: 13 pads with 11 to 26 > 24, so each pair differs.
    assert [p.input_ids.shape for p in parts] == [(1, 13), (2, 11), (1, 9)]
    assert all(p.input_ids.numel() <= 24 for p in parts)
    assert sum(p.tokens for p in parts) == batch.tokens == 15
    whole = gradients(policy, [batch])
    split = gradients(policy, parts)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # micro_batch_size still splits by rows when no budget is set.
    by_rows = micro_batches(batch, micro_batch_size=3)
    assert [p.input_ids.shape[0] for p in by_rows] == [3, 1]
    for name, grad in gradients(policy, by_rows).items():
        torch.testing.assert_close(grad, whole[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_path) -> None:
    plain = make_policy(tiny_model_path)
    checkpointed = make_policy(tiny_model_path, gradient_checkpointing=True)
    assert (
        checkpointed.learner.model.is_gradient_checkpointing
        and not plain.learner.model.is_gradient_checkpointing
    )
    expected = gradients(plain, [advantaged_batch(plain)])
    # Count the passes through one layer: checkpointing runs it again in the backward.
    mlp = checkpointed.learner.model.model.layers[0].mlp
    passes, forward = [], mlp.forward
    mlp.forward = lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs)
    for name, grad in gradients(checkpointed, [advantaged_batch(checkpointed)]).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    assert len(passes) == 2


def test_one_update_per_step_never_clips(tiny_model_path) -> None:
    """Today's behaviour: the proximal policy is the current one, every ratio is 1."""
    policy = make_policy(tiny_model_path, learning_rate=5e-2)
    for version in range(2):
        metrics = policy.train_step(group(), version)
        assert metrics["optimizer_steps"] == 1
        assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
        assert metrics["clip_frac_high"] == metrics["clip_frac_low"] == 0.0


def test_the_second_minibatch_is_clipped_against_the_proximal_policy(tiny_model_path) -> None:
    policy = make_policy(tiny_model_path, learning_rate=5e-2, minibatches_per_step=2)
    before = {name: p.detach().clone() for name, p in policy.learner.model.named_parameters()}
    metrics = policy.train_step(group(), 0)
    first, second = policy.step.update_metrics
    assert metrics["optimizer_steps"] == 2
    # The first update runs on the weights the proximal logprobs came from: ratio 1.
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert first["clip_frac_high"] == first["clip_frac_low"] == 0.0
    # The second sees the weights the first moved: the ratio leaves 1 and the clip acts.
    assert second["ratio_max"] - second["ratio_min"] > 0.1, second
    assert second["clip_frac_high"] + second["clip_frac_low"] > 0, second
    # Reported metrics are the mean over the two updates.
    assert metrics["clip_frac_high"] == pytest.approx(
        (first["clip_frac_high"] + second["clip_frac_high"]) / 2
    )
    assert metrics["ratio_max"] == max(first["ratio_max"], second["ratio_max"])
    # Mismatch and entropy come from the weights before the step (the proximal pass).
    assert metrics["mismatch_tokens"] == 15
    assert any(not torch.equal(p, before[n]) for n, p in policy.learner.model.named_parameters())


def test_epochs_reuse_the_proximal_logprobs_and_the_reference_is_computed_once(
    tiny_model_path,
) -> None:
    policy = make_policy(
        tiny_model_path,
        learning_rate=5e-2,
        epochs_per_step=2,
        kl={"coef": 0.1},
    )
    metrics = policy.train_step(group(), 0)
    first, second = policy.step.update_metrics
    assert metrics["optimizer_steps"] == 2
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second["ratio_mean"] - 1.0) > 1e-3
    # The reference is the initial model: no KL before the first update, some after it.
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and second["kl"] > 1e-4
    assert metrics["kl"] == pytest.approx((first["kl"] + second["kl"]) / 2)


def test_entropy_mean_is_that_of_the_generated_tokens_at_the_sampling_temperature(
    tiny_model_path,
) -> None:
    policy = Policy(tiny_model_path, TrainerConfig(), RLSection(group_size=4, temperature=0.7))
    batch = collate(group(), policy.learner.pad_token_id)
    with torch.no_grad():
        logits = policy.step.updater.logits(policy.learner.model, batch)
    entropy = token_entropy(logits, 0.7)
    expected = float((entropy * batch.mask).sum() / batch.mask.sum())
    metrics = policy.train_step(group(), 0)
    assert metrics["entropy_mean"] == pytest.approx(expected, rel=1e-5)
    assert 0 < expected < np.log(logits.shape[-1])


def test_bf16_keeps_float32_master_weights_and_loss_math(tiny_model_path) -> None:
    fp32 = make_policy(tiny_model_path)
    bf16 = make_policy(tiny_model_path, precision="bf16")
    batch = collate(group(), bf16.learner.pad_token_id)
    with torch.no_grad():
        assert bf16.step.updater.logits(bf16.learner.model, batch).dtype == torch.bfloat16
        low, full = (
            bf16.step.updater.logprobs(bf16.learner.model, batch),
            fp32.step.updater.logprobs(fp32.learner.model, batch),
        )
    assert low.dtype == torch.float32
    difference = float(((low - full) * batch.mask).abs().max())
    assert 0 < difference < 0.1  # bf16 did run, and stayed close
    bf16.step.updater.accumulate(bf16.step.updater.parts(advantaged_batch(bf16)), 0)
    assert all(p.grad.dtype == torch.float32 for p in bf16.learner.model.parameters())
    metrics = bf16.train_step(group(), 0)
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    assert all(p.dtype == torch.float32 for p in bf16.learner.model.parameters())
    moments = [s["exp_avg_sq"] for s in bf16.learner.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    published = dict(bf16.named_weights())
    assert {t.dtype for t in published.values()} == {torch.float32}
    assert all(torch.equal(published[n], p) for n, p in bf16.learner.model.named_parameters())


def test_adam_settings_reach_the_optimizer_and_win_over_a_checkpoint(
    tiny_model_path, tmp_path
) -> None:
    saved = make_policy(tiny_model_path)
    saved.train_step(group(), 0)
    folder = saved.save_checkpoint(tmp_path / "ckpt", step=1, version=1)
    policy = make_policy(tiny_model_path, adam_betas=[0.8, 0.95], adam_eps=1e-6, weight_decay=0.1)
    (settings,) = policy.learner.optimizer.param_groups
    assert (settings["betas"], settings["eps"]) == ((0.8, 0.95), 1e-6)
    policy.restore(folder)
    (settings,) = policy.learner.optimizer.param_groups
    assert (settings["betas"], settings["eps"], settings["weight_decay"]) == (
        (0.8, 0.95),
        1e-6,
        0.1,
    )
    assert policy.learner.optimizer_steps == 1


def test_a_resumed_run_continues_the_lr_schedule(tiny_model_path, tmp_path) -> None:
    # Linear over rl.max_steps x 1 x 1 = 4 updates, 2 of warm-up, down to 0.1:
    # factors 0.5, 1, 1, 0.55.
    settings = dict(
        learning_rate=1e-2,
        lr_schedule=LRScheduleConfig(type="linear", warmup_steps=2, min_lr_ratio=0.1),
    )
    straight = make_policy(tiny_model_path, **settings)
    rates = [straight.train_step(group(), v)["learning_rate"] for v in range(2)]
    folder = straight.save_checkpoint(tmp_path / "ckpt", step=2, version=2)
    rates += [straight.train_step(group(), v)["learning_rate"] for v in (2, 3)]
    assert rates == pytest.approx([5e-3, 1e-2, 1e-2, 5.5e-3])

    resumed = make_policy(tiny_model_path, **settings)
    assert resumed.learner.learning_rate() == pytest.approx(5e-3)
    resumed.restore(folder)
    assert resumed.learner.optimizer_steps == 2
    assert [resumed.train_step(group(), v)["learning_rate"] for v in (2, 3)] == pytest.approx(
        rates[2:]
    )
    for (name, ours), theirs in zip(
        resumed.learner.model.named_parameters(), straight.learner.model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8, msg=name)


def test_average_means_rows_and_takes_extremes() -> None:
    rows = [{"loss": 1.0, "ratio_max": 1.5, "ratio_min": 0.9}, {"loss": 3.0, "ratio_max": 1.2}]
    assert average(rows) == {"loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.9}
    assert average(rows, [0.75, 0.25])["loss"] == pytest.approx(1.5)


def test_advantage_settings_reach_the_step(tiny_model_path) -> None:
    """trainer.algorithm.advantage picks the estimator, trainer.algorithm.reward_clip clips rewards first, and
    StarPO-S's filter zeroes the groups whose rewards vary least."""
    trajectories = group() + group()
    rewards = torch.tensor([3.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    policy = make_policy(tiny_model_path, advantage={"type": "dr_grpo"}, reward_clip=1.0)
    advantages, per_turn = policy.step.advantages.advantages(trajectories, rewards)
    # Clipped to [1, 0, 1, 0 | 1, 1, 1, 0], minus each group's mean (0.5, 0.75).
    assert advantages.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0.25, 0.25, 0.25, -0.75])
    assert per_turn is None
    policy.step.config.algorithm.advantage = TrainerConfig(
        advantage={"type": "rloo"}
    ).algorithm.advantage
    policy.step.config.algorithm.reward_clip = None
    # RLOO on the raw rewards: 3 - 1/3, 0 - 4/3, 1 - 1, 0 - 4/3 | ...
    assert policy.step.advantages.advantages(trajectories, rewards)[0].tolist()[
        :4
    ] == pytest.approx([3 - 1 / 3, -4 / 3, 0.0, -4 / 3])
    policy.step.config.algorithm.advantage = TrainerConfig(
        advantage={"type": "episode", "keep_groups_fraction": 0.5}
    ).algorithm.advantage
    kept = policy.step.advantages.advantages(trajectories, rewards)[0]
    # Group 0's rewards vary more (std 1.22 against 0.43): group 1 is left out.
    assert kept[:4].abs().sum() > 0 and kept[4:].tolist() == [0.0] * 4


def critic_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.step.critic.backend.module.named_parameters()}


def test_the_critic_starts_at_zero_and_its_value_loss_falls_on_a_fixed_batch(
    tiny_model_path,
) -> None:
    """advantage: gae. With lambda = gamma = 1 the returns are the rewards (fixed targets),
    so the critic's loss on one batch must fall step after step; before its first update
    every value is 0, so the whitened advantages are the whitened rewards."""
    policy = make_policy(
        tiny_model_path,
        advantage={"type": "gae", "lam": 1.0, "critic": {"learning_rate": 1e-2}},
        epochs_per_step=2,
    )
    assert policy.step.critic is not None
    first = policy.train_step(group(), 0)
    assert first["critic_value_mean"] == 0.0
    # Rewards 1, 0, 1, 0 on 4, 3, 6 and 2 generated tokens: 10 of 15 tokens have return 1.
    assert first["critic_return_mean"] == pytest.approx(10 / 15, rel=1e-5)
    assert first["sequences_with_signal"] == 4.0 and first["optimizer_steps"] == 2.0
    losses = [first["critic_loss"]]
    losses += [policy.train_step(group(), v)["critic_loss"] for v in range(1, 8)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert policy.train_step(group(), 8)["critic_explained_variance"] > 0.3


def test_the_critic_is_checkpointed_and_resumed_exactly(tiny_model_path, tmp_path) -> None:
    settings = dict(advantage={"type": "gae", "critic": {"learning_rate": 1e-2}})
    straight = make_policy(tiny_model_path, **settings)
    straight.train_step(group(), 0)
    folder = straight.save_checkpoint(tmp_path / "ckpt", step=1, version=1)
    assert (folder / "critic").is_dir()
    after = straight.train_step(group(), 1)

    resumed = make_policy(tiny_model_path, **settings)
    resumed.restore(folder)
    again = resumed.train_step(group(), 1)
    assert again["critic_loss"] == pytest.approx(after["critic_loss"], rel=1e-6)
    assert again["critic_value_mean"] == pytest.approx(after["critic_value_mean"], rel=1e-6)
    ours, theirs = critic_weights(resumed), critic_weights(straight)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-8, msg=name)
    # A checkpoint made without a critic starts one afresh, with a warning.
    plain = make_policy(tiny_model_path)
    plain.train_step(group(), 0)
    fresh = make_policy(tiny_model_path, **settings)
    start = critic_weights(fresh)
    fresh.restore(plain.save_checkpoint(tmp_path / "plain", step=1, version=1))
    assert all(torch.equal(start[n], p) for n, p in critic_weights(fresh).items())


def test_a_kl_in_the_reward_is_paid_by_the_tokens_before_it(tiny_model_path) -> None:
    """kl.in_reward with REINFORCE++: token rewards lose coef x the KL estimate, each
    token's advantage is its return to go, whitened over the batch's tokens."""
    policy = make_policy(
        tiny_model_path,
        advantage={"type": "reinforce_plus_plus"},
        kl={"coef": 0.1, "estimator": "k1", "in_reward": True},
    )
    half, quarter = math.log(0.5), math.log(0.25)
    part = TokenBatch(
        input_ids=torch.zeros(1, 4, dtype=torch.long),
        attention=torch.ones(1, 4, dtype=torch.long),
        targets=torch.zeros(1, 3, dtype=torch.long),
        mask=torch.tensor([[0.0, 1.0, 1.0]]),
        behaviour_logprobs=torch.zeros(1, 3),
        policy_versions=torch.zeros(1, 3, dtype=torch.long),
        proximal_logprobs=torch.tensor([[0.0, half, half]]),
        reference_logprobs=torch.tensor([[0.0, quarter, half]]),
        token_rewards=torch.tensor([[0.0, 0.0, 1.0]]),
    )
    metrics = policy.step.advantages._token_advantages([part])
    # k1 = log pi - log ref = ln 2 on the first generated token, 0 on the second: mean
    # ln 2 / 2. Rewards -0.1 ln 2 and 1; returns to go 1 - 0.0693 and 1; whitened: -1, 1.
    assert metrics["kl"] == pytest.approx(math.log(2) / 2)
    assert part.token_rewards.tolist()[0] == pytest.approx([0.0, -0.1 * math.log(2), 1.0])
    assert part.advantages.tolist()[0] == pytest.approx([0.0, -1.0, 1.0], abs=1e-3)
    # Through a step: at the start the policy is its reference (no KL), so the advantages
    # are the whitened rewards, 1 on 10 of 15 tokens: |A| = 0.7071 there, 1.4142 on 5.
    first = policy.train_step(group(), 0)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["advantage_abs_mean"] == pytest.approx((10 * 0.70711 + 5 * 1.41421) / 15, 1e-4)
    assert first["sequences_with_signal"] == 4.0
    assert policy.train_step(group(), 1)["kl"] != 0.0


def test_a_kl_in_the_reward_needs_an_estimator_that_takes_token_rewards() -> None:
    with pytest.raises(ValueError, match="gae and reinforce_plus_plus"):
        TrainerConfig(kl={"coef": 0.1, "in_reward": True})
    with pytest.raises(ValueError, match="kl.coef > 0"):
        TrainerConfig(advantage={"type": "gae"}, kl={"in_reward": True})


def test_overlong_responses_are_penalised_or_left_out(tiny_model_path) -> None:
    """trainer.algorithm.overlong: the soft penalty lowers the reward of long responses before the
    advantages; mask_truncated leaves responses cut at the limit out of the loss."""
    trajectories = group()  # 4, 3, 6 and 2 generated tokens; rewards 1, 0, 1, 0
    trajectories[2] = dataclasses.replace(trajectories[2], finish_reason="length")
    policy = make_policy(
        tiny_model_path,
        advantage={"type": "dr_grpo"},
        overlong={"penalty_tokens": 2, "max_tokens": 6},
    )
    rewards, truncated, metrics = policy.step.advantages._shaped_rewards(
        trajectories, torch.tensor([1.0, 0.0, 1.0, 0.0])
    )
    # Free up to 4 tokens: only the 6-token response pays, -1 (at the limit).
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and truncated == [False, False, True, False]
    assert metrics == {"overlong_penalty_mean": -0.25, "truncated_fraction": 0.25}
    masked = make_policy(tiny_model_path, overlong={"mask_truncated": True})
    out = masked.train_step(trajectories, 0)
    assert out["sequences_with_signal"] == 3.0 and out["truncated_fraction"] == 0.25
    with pytest.raises(ValueError, match="max_tokens"):
        make_policy(tiny_model_path, overlong={"penalty_tokens": 2}).train_step(group(), 0)


def test_reward_normalization_by_batch_and_running_resumes(tiny_model_path, tmp_path) -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch = make_policy(tiny_model_path, reward_normalization="batch")
    assert batch.step.advantages._shaped_rewards(group(), rewards)[0].tolist() == pytest.approx(
        [1.0, -1.0, 1.0, -1.0], abs=1e-5
    )
    running = make_policy(tiny_model_path, reward_normalization="running")
    running.train_step(group(), 0)  # seen: 1, 0, 1, 0
    shaped, _, metrics = running.step.advantages._shaped_rewards(
        group(), torch.tensor([3.0, 3.0, 3.0, 3.0])
    )
    # Seen now: four 3s too, mean 14 / 8 = 1.75, std sqrt(38 / 8 - 1.75^2) = 1.299.
    assert metrics["reward_running_mean"] == pytest.approx(1.75)
    assert shaped.tolist() == pytest.approx([(3 - 1.75) / 1.2990] * 4, rel=1e-3)
    folder = running.save_checkpoint(tmp_path / "ckpt", step=1, version=1)
    resumed = make_policy(tiny_model_path, reward_normalization="running")
    resumed.restore(folder)
    assert (
        resumed.step.advantages.reward_moments.state_dict()
        == running.step.advantages.reward_moments.state_dict()
    )


def test_packed_rows_hold_each_sequence_apart() -> None:
    batch = supervised_batch([([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1]), ([4] * 6, [1] * 6)], 0, 6)
    # First fit within 6 tokens: 3 + 2 in one row, the 6 alone.
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [4] * 6]
    assert batch.documents.tolist() == [[0, 0, 0, 1, 1, -1], [0] * 6]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0], list(range(6))]
    # Targets 6, 7 train; 8 is not predicted from 7 (another sequence); 9 trains.
    assert batch.mask.tolist() == [[1, 1, 0, 1, 0], [1] * 5]
    attention = packed_attention(batch.documents)[0, 0]
    assert attention[4].tolist() == [False, False, False, True, True, False]
    assert attention[5].tolist() == [False] * 5 + [True]  # padding sees only itself


def test_a_packed_supervised_step_equals_the_padded_one(tiny_model_path) -> None:
    sequences = [
        (PROMPT + response, [0] * len(PROMPT) + [1] * len(response)) for response in RESPONSES
    ]
    padded, packed = make_supervised(tiny_model_path), make_supervised(tiny_model_path)
    one = padded.step(sequences)
    other = packed.step(sequences, pack_tokens=24)
    # 11, 10, 13 and 9 tokens in rows of 24: 11 + 10 and 13 + 9.
    assert (one["rows"], other["rows"]) == (4.0, 2.0)
    assert other["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert other["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for (name, ours), theirs in zip(
        packed.learner.model.named_parameters(), padded.learner.model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)


def distilled_group(policy: Policy, lift: float) -> list[Trajectory]:
    """group() with teacher logprobs: the policy's own, `lift` higher on each response's
    second token."""
    trajectories = group()
    student = policy.step.logprobs(
        policy.learner.model, collate(trajectories, policy.learner.pad_token_id), slice(None)
    )
    for row, trajectory in enumerate(trajectories):
        n = trajectory.num_tokens
        teacher = np.zeros(n, np.float32)
        teacher[1:] = student[row, : n - 1].detach().numpy()
        teacher[len(PROMPT) + 1] += lift
        trajectory.teacher_logprobs = np.where(trajectory.loss_mask == 1, teacher, 0)
        trajectory.teacher_logprobs = trajectory.teacher_logprobs.astype(np.float32)
    return trajectories


def test_on_policy_distillation_moves_the_student_toward_the_teacher(tiny_model_path) -> None:
    """Each sampled token's advantage is teacher minus student logprob: where they agree
    nothing moves; where the teacher is likelier the student's logprob rises."""
    policy = make_policy(
        tiny_model_path, advantage={"type": "on_policy_distill"}, learning_rate=1e-3
    )
    agree = policy.train_step(distilled_group(policy, 0.0), 0)
    # 15 generated tokens, all with zero advantage: no gradient.
    assert agree["teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    assert agree["sequences_with_signal"] == 4.0 and agree["grad_norm"] == pytest.approx(
        0.0, abs=1e-4
    )
    trajectories = distilled_group(policy, 2.0)
    batch = collate(trajectories, policy.learner.pad_token_id)
    second = [len(PROMPT)] * 4  # target index of each response's second token
    before = policy.step.logprobs(policy.learner.model, batch, slice(None))
    metrics = policy.train_step(trajectories, 1)
    # KL estimate: student minus teacher, -2 on 4 of the 15 tokens.
    assert metrics["teacher_kl"] == pytest.approx(-2.0 * 4 / 15, abs=1e-4)
    after = policy.step.logprobs(policy.learner.model, batch, slice(None))
    rows = torch.arange(4)
    assert bool((after[rows, second] > before[rows, second]).all()), (before, after)


def test_on_policy_distillation_adds_the_task_reward_and_needs_the_teacher(
    tiny_model_path,
) -> None:
    policy = make_policy(
        tiny_model_path, advantage={"type": "on_policy_distill", "reward_weight": 0.5}
    )
    rewards = torch.tensor(REWARDS)
    # GRPO of 1, 0, 1, 0 is +-1; half of it.
    assert policy.step.advantages._distill_task_advantages(rewards).tolist() == pytest.approx(
        [0.5, -0.5, 0.5, -0.5], abs=1e-5
    )
    with pytest.raises(ValueError, match="needs the teacher's logprobs of every sample"):
        policy.train_step(group(), 0)
    plain = make_policy(tiny_model_path, advantage={"type": "on_policy_distill"})
    assert plain.step.advantages._distill_task_advantages(rewards).tolist() == [0.0] * 4


def topk_sequences(k: int = 4) -> tuple[list, list]:
    """RESPONSES after PROMPT, with a made-up teacher: at every response token it puts
    0.9 on that token and spreads 0.05 over k - 1 others."""
    sequences, top = [], []
    for response in RESPONSES:
        ids = PROMPT + response
        top_ids = np.zeros((len(ids), k), np.int64)
        top_logprobs = np.zeros((len(ids), k), np.float32)
        for t in range(len(PROMPT), len(ids)):
            top_ids[t] = [ids[t]] + [(ids[t] + j) % 100 + 1 for j in range(1, k)]
            top_logprobs[t] = [math.log(0.9)] + [math.log(0.05 / (k - 1))] * (k - 1)
        sequences.append((ids, [0] * len(PROMPT) + [1] * len(response)))
        top.append((top_ids, top_logprobs))
    return sequences, top


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl"])
def test_token_level_distillation_steps_lower_the_kl_packed_or_not(tiny_model_path, loss) -> None:
    padded = make_supervised(tiny_model_path, learning_rate=3e-3)
    packed = make_supervised(tiny_model_path)
    sequences, top = topk_sequences()
    first = padded.loss(sequences, None, loss, top)
    # Packing changes nothing: the same loss on rows holding two sequences each.
    assert packed.loss(sequences, 24, loss, top)["loss"] == pytest.approx(first["loss"], rel=1e-5)
    for _ in range(20):
        padded.step(sequences, None, loss, top)
    # Measured over 20 steps: forward 3.97 -> 1.73, reverse 2.78 -> 2.06 (mode-seeking is slower
    # from a student that spreads its mass over the whole vocabulary).
    assert padded.loss(sequences, None, loss, top)["loss"] < 0.85 * first["loss"]
    with pytest.raises(ValueError, match="needs the teacher's top-k"):
        padded.step(sequences, None, loss, None)


def test_a_weights_snapshot_is_what_the_step_left_and_the_next_step_does_not_change(
    tiny_model_path,
) -> None:
    """What an overlapped publish sends (`trainer.weights.overlap_publish`): a copy, so the step
    after it cannot change the weights halfway through being sent."""
    policy = make_policy(tiny_model_path, learning_rate=5e-2)
    policy.train_step(group(), 0)
    snapshot = policy.weights_snapshot()
    after_first = {name: tensor.clone() for name, tensor in policy.named_weights()}
    assert [name for name, _ in snapshot] == list(after_first)
    assert all(torch.equal(tensor, after_first[name]) for name, tensor in snapshot)
    policy.train_step(group(), 1)
    moved = [n for n, t in policy.named_weights() if not torch.equal(t, after_first[n])]
    assert moved  # the second step changed the model...
    assert all(torch.equal(tensor, after_first[name]) for name, tensor in snapshot)  # ...not it
