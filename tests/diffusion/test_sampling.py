"""Batched sampling (rollwire.diffusion.sampling): a sample depends on its seed alone, the
recorded SDE steps are the ones asked for, and recomputing their log-probabilities from
the recorded latents gives what sampling recorded."""

from __future__ import annotations

import pytest
import torch

from rollwire.diffusion.sampling import SamplingSettings, sample, step_logprobs


def toy_velocity(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The exact velocity for data x0 ~ N(label / 10, 0.2^2) per pixel."""
    m = (labels.to(x.dtype) / 10.0).view(-1, 1, 1, 1)
    s, a, b = 0.2, (1 - t).view(-1, 1, 1, 1), t.view(-1, 1, 1, 1)
    variance = a * a * s * s + b * b
    centred = x - a * m
    return (b / variance) * centred - (m + (a * s * s / variance) * centred)


def test_a_sample_depends_on_its_seed_alone_and_its_steps_are_recorded() -> None:
    settings = SamplingSettings(steps=8, eta=0.7, sde_window=(2, 6))
    alone = sample(toy_velocity, torch.tensor([3]), [11], settings)
    batch = sample(toy_velocity, torch.tensor([5, 3, 7]), [4, 11, 9], settings)
    torch.testing.assert_close(batch.images[1], alone.images[0])
    torch.testing.assert_close(batch.logprobs[1], alone.logprobs[0])
    assert batch.recorded_steps == [2, 3, 4, 5]
    assert batch.latents.shape == (3, 5, 1, 8, 8) and batch.logprobs.shape == (3, 4)
    # Each class lands near its mean.
    means = batch.images.flatten(1).mean(dim=1)
    torch.testing.assert_close(means, torch.tensor([0.5, 0.3, 0.7]), atol=0.08, rtol=0)
    # Recomputed from the recorded latents: the recorded log-probabilities.
    again = step_logprobs(
        toy_velocity, batch.latents, torch.tensor([5, 3, 7]), batch.recorded_steps, settings
    )
    torch.testing.assert_close(again, batch.logprobs, atol=1e-5, rtol=0)


def test_the_ode_records_its_window_deterministically_and_bad_windows_are_refused() -> None:
    plain = sample(toy_velocity, torch.tensor([2, 2]), [0, 0], SamplingSettings(steps=4))
    assert plain.recorded_steps == [] and plain.logprobs.shape == (2, 0)
    torch.testing.assert_close(plain.images[0], plain.images[1])
    # An ODE window (reward feedback learning's) keeps the latents on the ODE's own path,
    # the last step included, with no log-probability.
    window = sample(toy_velocity, torch.tensor([2, 2]), [0, 0], SamplingSettings(4, 0.0, (2, 4)))
    assert window.recorded_steps == [2, 3] and window.latents.shape == (2, 3, 1, 8, 8)
    assert (window.logprobs == 0).all()
    torch.testing.assert_close(window.images, plain.images, atol=0, rtol=0)
    torch.testing.assert_close(window.latents[:, -1], plain.images, atol=0, rtol=0)
    with pytest.raises(ValueError, match="within"):
        SamplingSettings(steps=4, sde_window=(2, 6))
    with pytest.raises(ValueError, match="last step"):
        SamplingSettings(steps=4, eta=1.0, sde_window=(0, 4))
    with pytest.raises(ValueError, match="seeds"):
        sample(toy_velocity, torch.tensor([1, 2]), [0], SamplingSettings())
