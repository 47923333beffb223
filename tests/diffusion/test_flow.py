"""Flow matching's sampling math (rollwire.diffusion.flow): the SDE step's log-probability
by hand, and the SDE keeping the ODE's marginals on data whose velocity is known exactly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rollwire.diffusion.flow import (
    logprob_of,
    ode_step,
    predicted_clean,
    sde_step,
    step_distribution,
    time_grid,
)


def test_one_sde_step_by_hand() -> None:
    # x = 0.5, v = 0.2, from t = 0.5 to 0.25 with eta = 1:
    # sigma_t = sqrt(0.5 / 0.5) = 1, dt = -0.25,
    # drift = v + sigma^2 / (2 t) (x + (1 - t) v) = 0.2 + 1 * (0.5 + 0.1) = 0.8,
    # mean = 0.5 - 0.25 * 0.8 = 0.3, std = 1 * sqrt(0.25) = 0.5;
    # x_next = 0.4: z = 0.2, log p = -0.02 - ln 0.5 - ln sqrt(2 pi) = -0.2457913...
    x, v = torch.tensor([[0.5]]), torch.tensor([[0.2]])
    mean, std = step_distribution(x, v, 0.5, 0.25, eta=1.0)
    assert mean.item() == pytest.approx(0.3) and std == pytest.approx(0.5)
    expected = -0.02 - math.log(0.5) - 0.5 * math.log(2 * math.pi)
    assert logprob_of(torch.tensor([[0.4]]), mean, std).item() == pytest.approx(expected, abs=1e-6)
    # Driven by noise 0.2: x_next = 0.3 + 0.5 * 0.2 = 0.4, the same log-probability.
    x_next, logprob = sde_step(x, v, 0.5, 0.25, 1.0, torch.tensor([[0.2]]))
    assert x_next.item() == pytest.approx(0.4) and logprob.item() == pytest.approx(expected)
    # A sample's log-probability is the sum over its dimensions.
    pair = logprob_of(torch.tensor([[0.4, 0.4]]), torch.tensor([[0.3, 0.3]]), 0.5)
    assert pair.item() == pytest.approx(2 * expected, abs=1e-6)
    # eta 0 is the ODE step, which has no log-probability.
    mean, std = step_distribution(x, v, 0.5, 0.25, eta=0.0)
    assert std == 0.0 and torch.equal(mean, ode_step(x, v, 0.5, 0.25))
    with pytest.raises(ValueError, match="no log-probability"):
        logprob_of(x, mean, std)
    assert predicted_clean(x, v, 0.5).item() == pytest.approx(0.4)


def test_time_grid_runs_from_noise_to_data_and_shifts_toward_noise() -> None:
    assert time_grid(4) == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = time_grid(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    assert all(s > t for s, t in zip(shifted[1:-1], time_grid(4)[1:-1], strict=True))
    with pytest.raises(ValueError):
        time_grid(0)


def exact_velocity(x: torch.Tensor, t: float, m: float, s: float) -> torch.Tensor:
    """E[noise - x0 | x_t = x] for data x0 ~ N(m, s^2): x_t = (1 - t) x0 + t noise."""
    a, b = 1.0 - t, t
    variance = a * a * s * s + b * b
    centred = x - a * m
    return (b / variance) * centred - (m + (a * s * s / variance) * centred)


@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_the_sde_ends_where_the_ode_does(eta: float) -> None:
    """From the same noise, 40 steps of the ODE and of the SDE both end at the data's
    distribution N(0.5, 0.3^2): the SDE's extra drift and noise keep the marginals."""
    m, s, count, steps = 0.5, 0.3, 40_000, 40
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(count, 1, generator=generator, dtype=torch.float64)
    grid = time_grid(steps)
    ode, sde = start.clone(), start.clone()
    logprobs = []
    for t, t_next in itertools.pairwise(grid):
        ode = ode_step(ode, exact_velocity(ode, t, m, s), t, t_next)
        noise = torch.randn(count, 1, generator=generator, dtype=torch.float64)
        if t_next > 0:
            velocity = exact_velocity(sde, t, m, s)
            std = step_distribution(sde, velocity, t, t_next, eta)[1]
            sde, logprob = sde_step(sde, velocity, t, t_next, eta, noise)
            logprobs.append((logprob.mean().item(), std))
        else:  # the last step to t = 0 is taken by the ODE (sigma_t has no limit there)
            sde = ode_step(sde, exact_velocity(sde, t, m, s), t, t_next)
    for name, end in (("ode", ode), ("sde", sde)):
        assert end.mean().item() == pytest.approx(m, abs=0.01), name
        assert end.std().item() == pytest.approx(s, abs=0.015), name
    # Each step's draws have their Gaussian's mean log-density, -(1 + ln(2 pi std^2)) / 2.
    for mean_logprob, std in logprobs:
        expected = -0.5 * (1.0 + math.log(2 * math.pi * std * std))
        assert mean_logprob == pytest.approx(expected, abs=0.02)
