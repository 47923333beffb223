"""The digits judge (rollwire.diffusion.judge): right on held-out digits, and its
quality measures tell real digits from noise and from copies of one image."""

from __future__ import annotations

import numpy as np
import pytest

from rollwire.diffusion.data import ANY, digits, label_of
from rollwire.diffusion.judge import digits_judge, diversity, frechet_distance


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
