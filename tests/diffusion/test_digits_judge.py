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


def test_the_torch_judge_is_the_numpy_judge_with_a_gradient() -> None:
    import torch

    from rollwire.diffusion.differentiable import TorchJudge

    judge = digits_judge()
    held, labels = digits("held_out")
    module = TorchJudge(judge)
    images = torch.from_numpy(held[:32]).requires_grad_(True)
    wanted = torch.from_numpy(labels[:32])
    log_probability = module.log_probability(images, wanted)
    expected = np.log(judge.probabilities(held[:32])[np.arange(32), labels[:32]])
    np.testing.assert_allclose(log_probability.detach().numpy(), expected, atol=1e-4)
    log_probability.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    # One gradient step on the pixels raises the wanted digit's probability.
    moved = (images + 0.05 * images.grad.sign()).clamp(-1, 1)
    assert (module.log_probability(moved, wanted) >= log_probability - 1e-6).all()


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
