"""A group's prompt computed once (rollwire.trainer.shared_prefix): the layout by hand, and
the logprobs, the proximal pass and the gradients equal to the plain rows'."""

from __future__ import annotations

import torch

from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.batching import (
    collate,
    micro_batches,
    packed_attention,
    per_token_advantages,
)
from rollwire.trainer.rl.policy import Policy
from rollwire.trainer.shared_prefix import pass_cost, share_prefixes
from tests.helpers.trajectories import PROMPT, group, tokens


def other_prompt() -> list[Trajectory]:
    """Two samples of a second prompt that begins like PROMPT and then differs, one of
    them a two-turn episode (an observation between its generated spans)."""
    prompt = [*PROMPT[:3], 5, 6]
    spans = [([41, 42, 1], [1, 1, 1]), ([43, 7, 8, 44, 1], [1, 0, 0, 1, 1])]
    return [
        tokens(prompt + response, [0] * len(prompt) + mask, i, float(i), group_id="o", ordinal=1)
        for i, (response, mask) in enumerate(spans)
    ]


def test_the_layout_by_hand() -> None:
    # Rows: [5 6 7 | 8 9], [5 6 7 | 10], [5 4 | 11]; "|" before the first trained token.
    rows = [
        ([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]),
        ([5, 6, 7, 10], [0, 0, 0, 1]),
        ([5, 4, 11], [0, 0, 1]),
    ]
    trajectories = [tokens(ids, mask, i) for i, (ids, mask) in enumerate(rows)]
    batch = collate(trajectories, 0)
    layout = share_prefixes(batch)
    assert layout is not None
    # The first two share "5 6"; "7" (whose logits predict the first response token)
    # goes with each response. The third row is alone: its prompt differs.
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 10], [5, 4, 11, 0, 0, 0, 0]]
    assert layout.documents.tolist() == [[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, -1, -1, -1, -1]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 0, 0, 0, 0]]
    assert (layout.tokens, layout.plain_tokens) == (10, 12)
    # Each target's logits: row 1's "10" is predicted by its own copy of "7" (position 5),
    # its "6" and "7" by the shared "5" and "6"; padding targets point anywhere.
    width = layout.width
    assert layout.index[1, :3].tolist() == [0, 1, 5]
    assert layout.index[0, :4].tolist() == [0, 1, 2, 3]
    assert layout.index[2, :2].tolist() == [width + 0, width + 1]
    attention = packed_attention(layout.documents, prefix=True)[0, 0]
    # Row 1's "10" sees the shared "5 6", its own "7" and itself; not row 0's response.
    assert attention[6].tolist() == [True, True, False, False, False, True, True]
    assert attention[1].tolist() == [True, True] + [False] * 5  # the prompt sees itself only
    # Rows that share nothing: the plain rows are as good.
    assert share_prefixes(collate(trajectories[1:], 0)) is None


def test_a_token_budget_keeps_a_prompts_rows_in_one_pass() -> None:
    # Prompt "5 6 7" in rows 0 and 2 (6 and 9 tokens), "5 4 3 2" in rows 1 and 3 (8, 7).
    # In 18 padded tokens longest first pairs 9 with 8 and 7 with 6: each pass holds two
    # prompts and shares nothing. Kept together, each prompt's pair is one pass.
    rows = [
        ([5, 6, 7, 8, 9, 1], [0, 0, 0, 1, 1, 1]),
        ([5, 4, 3, 2, 12, 13, 14, 1], [0, 0, 0, 0, 1, 1, 1, 1]),
        ([5, 6, 7, 8, 9, 10, 11, 12, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1]),
        ([5, 4, 3, 2, 8, 9, 1], [0, 0, 0, 0, 1, 1, 1]),
    ]
    batch = collate([tokens(ids, mask, i) for i, (ids, mask) in enumerate(rows)], 0)
    apart = micro_batches(batch, 64, max_tokens=18)
    together = micro_batches(batch, 64, max_tokens=18, keep_prompts_together=True)
    assert [p.lengths for p in apart] == [[8, 9], [6, 7]]  # rows in the batch's order
    assert all(share_prefixes(p) is None for p in apart)
    assert [p.lengths for p in together] == [[6, 9], [8, 7]]
    assert all(share_prefixes(p) is not None for p in together)
    assert all(p.input_ids.numel() <= 18 for p in together)


def prepared(policy: Policy, trajectories: list[Trajectory]):
    batch = collate(trajectories, policy.learner.pad_token_id)
    rewards = torch.tensor([t.reward for t in trajectories]) - 0.4
    batch.advantages = per_token_advantages(trajectories, rewards, None, batch.mask.shape[1])
    return batch


def test_logprobs_proximal_pass_and_gradients_equal_the_plain_rows(tiny_model_path) -> None:
    trajectories = group() + other_prompt()
    shared = Policy(tiny_model_path, TrainerConfig(), RLSection(group_size=4, max_steps=4))
    plain = Policy(
        tiny_model_path,
        TrainerConfig(batching={"share_prefix": False}),
        RLSection(group_size=4, max_steps=4),
    )
    widths = []
    model = shared.learner.model
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    results = {}
    for name, policy in (("shared", shared), ("plain", plain)):
        updater = policy.step.updater
        batch = prepared(policy, trajectories)
        mask = batch.mask.bool()
        logprobs = updater.logprobs(policy.learner.model, batch)
        updater.proximal_pass([batch], trainer_version=0)
        policy.learner.model.zero_grad(set_to_none=True)
        updater.accumulate([batch], trainer_version=0)
        grads = {n: p.grad.clone() for n, p in policy.learner.model.named_parameters()}
        results[name] = (logprobs[mask], batch.proximal_logprobs[mask], grads)
    hook.remove()
    # Six rows became two: PROMPT's four samples and the other prompt's two.
    assert widths and all(shape[0] == 2 for shape in widths), widths
    (ours, our_proximal, our_grads), (theirs, their_proximal, their_grads) = (
        results["shared"],
        results["plain"],
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_proximal, their_proximal, rtol=1e-5, atol=1e-6)
    assert set(our_grads) == set(their_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # The gradient is not trivially zero: the comparison above means something.
    assert sum(float(g.abs().sum()) for g in our_grads.values()) > 0


def test_long_responses_in_large_groups_stay_plain() -> None:
    sizes = {"hidden": 576, "intermediate": 1536, "layers": 30, "vocab": 49152}
    # SmolLM2's shape, 8 samples of 60 prompt + 48 response tokens: shared is cheaper.
    plain, shared = pass_cost(8, 108, sizes), pass_cost(1, 60 + 8 * 49, sizes)
    assert shared < 0.7 * plain
    # 8 samples of 8,000 generated tokens after a 100-token prompt: attention over one
    # 64,000-token row would cost far more than the prompt saves.
    assert pass_cost(1, 100 + 8 * 8001, sizes) > pass_cost(8, 8100, sizes)
