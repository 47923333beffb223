"""The digits judge (rollwire.diffusion.judge): right on held-out digits, and its
quality measures tell real digits from noise and from copies of one image."""

from __future__ import annotations

import numpy as np
import pytest

from rollwire.diffusion.data import ANY, digits, label_of
from rollwire.diffusion.judge import (
    class_matched_frechet,
    digits_judge,
    diversity,
    frechet_distance,
    relative_diversity,
    within_class_diversity,
)


def test_the_judge_knows_held_out_digits_and_its_measures_separate_real_from_fake() -> None:
    judge = digits_judge()
    train, _ = digits("train")
    held, labels = digits("held_out")
    assert len(train) == 1500 and len(held) == 297
    assert judge.accuracy(held, labels) >= 0.97  # 0.987 as built (seed 0)
    real = frechet_distance(judge.features(train), judge.features(held))
    noise = np.random.default_rng(0).uniform(-1, 1, size=(297, 1, 8, 8))
    fake = frechet_distance(judge.features(noise), judge.features(held))
    assert real < 5 and fake > 20 * real, (real, fake)  # 2.0 and 148 as built
    threes = judge.features(held[labels == 3])
    copies = judge.features(np.repeat(held[labels == 3][:1], 20, axis=0))
    assert diversity(copies) == pytest.approx(0.0, abs=1e-6)
    assert diversity(threes) > 1.0  # 7.7 as built
    probabilities = judge.probabilities(held[:5])
    assert probabilities.shape == (5, 10) and np.allclose(probabilities.sum(axis=1), 1.0)


def test_prompts_name_a_digit_or_any() -> None:
    assert [label_of(p) for p in ("3", "a 3", "digit 7", "Digit 0", "any", "")] == [
        3,
        3,
        7,
        0,
        ANY,
        ANY,
    ]
    for bad in ("three", "12", "a cat"):
        with pytest.raises(ValueError, match="not a digits prompt"):
            label_of(bad)
    with pytest.raises(ValueError, match="split"):
        digits("test")


def test_every_differentiable_twin_pays_what_the_reward_server_pays_with_a_gradient() -> None:
    import torch

    from rollwire.diffusion.differentiable import DIFFERENTIABLE, differentiable_reward
    from rollwire.reward.images import IMAGE_SCORERS
    from rollwire.reward.scorers import ScoreInput
    from rollwire.services.core.wire import array_bytes

    held, labels = digits("held_out")
    rng = np.random.default_rng(0)
    cases = {
        "digit": (held[:24], [str(d) for d in labels[:24]], [{}] * 24),
        "brightness": (held[:6], [""] * 6, [{}] * 6),
        "contrast": (held[:6], [""] * 6, [{}] * 6),
        "colour": (
            rng.uniform(-1, 1, (6, 3, 4, 4)).astype(np.float32),
            [""] * 6,
            [{"target": [0.5, -0.2, 0.0]}] * 6,
        ),
    }
    assert set(cases) == set(DIFFERENTIABLE)
    for domain, (images, references, metadata) in cases.items():
        _, scorer = IMAGE_SCORERS[domain]
        expected = [
            scorer(ScoreInput("", ref, metadata=extra, image=array_bytes(image, "<f4"))).reward
            for image, ref, extra in zip(images, references, metadata, strict=True)
        ]
        pixels = torch.from_numpy(images).requires_grad_(True)
        reward = differentiable_reward(domain)(pixels, references, metadata)
        np.testing.assert_allclose(reward.detach().numpy(), expected, atol=1e-5, err_msg=domain)
        reward.sum().backward()
        assert pixels.grad is not None and pixels.grad.abs().sum() > 0, domain
    # One signed gradient step on the pixels raises the judge's probability of the digit.
    twin = differentiable_reward("digit")
    pixels = torch.from_numpy(held[:24]).requires_grad_(True)
    wanted = [str(d) for d in labels[:24]]
    before = twin(pixels, wanted, [{}] * 24)
    before.sum().backward()
    moved = (pixels + 0.05 * pixels.grad.sign()).clamp(-1, 1)
    assert (twin(moved, wanted, [{}] * 24) >= before - 1e-6).all()
    with pytest.raises(ValueError, match="no gradient"):
        twin(pixels, wanted[:1] * 24, [{"pay": "correct"}] * 24)
    with pytest.raises(ValueError, match="no differentiable twin"):
        differentiable_reward("math")


def test_the_class_matched_measures_compare_samples_with_real_digits_of_their_classes() -> None:
    """Real digits score as real digits whatever their class mix: a set of 3s and a set
    of every digit both read near the train-vs-held-out floor and near diversity 1, while
    3s measured against all ten digits (what a plain Frechet distance would do) do not;
    the same 3s copied once each read diversity 0."""
    judge = digits_judge()
    train, train_labels = digits("train")
    held, labels = digits("held_out")
    real = judge.features(train)
    held_features = judge.features(held)
    threes = held_features[labels == 3]
    matched_threes = class_matched_frechet(threes, labels[labels == 3], real, train_labels)
    matched_all = class_matched_frechet(held_features, labels, real, train_labels)
    unmatched = frechet_distance(threes, real)
    # One class: exactly the Frechet distance to that class's real digits.
    assert matched_threes == pytest.approx(
        frechet_distance(threes, real[train_labels == 3]), rel=1e-9
    )
    assert matched_threes < 10 and matched_all < 5 and unmatched > 5 * matched_threes
    assert relative_diversity(held_features, labels, real, train_labels) == pytest.approx(
        1.0, abs=0.1
    )
    assert relative_diversity(threes, labels[labels == 3], real, train_labels) == pytest.approx(
        1.0, abs=0.15
    )
    copies = np.repeat(threes[:1], 10, axis=0)
    assert relative_diversity(copies, np.full(10, 3), real, train_labels) == pytest.approx(
        0.0, abs=1e-6
    )
    # A class seen once has no within-class spread: it is left out, not counted as 0.
    assert within_class_diversity(
        np.concatenate([threes, held_features[:1]]), np.r_[np.full(len(threes), 3), 11]
    ) == pytest.approx(diversity(threes))
