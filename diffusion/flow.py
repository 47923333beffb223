"""Flow matching's sampling math: the time grid, the ODE step, the SDE step with the same
marginals, and that step's log-probability, computed one way for the engine that samples
and the trainer that recomputes.

Convention (rectified flow, as diffusers' `FlowMatchEulerDiscreteScheduler`): a noisy
sample is `x_t = (1 - t) * x0 + t * noise`, `t` runs from 1 (noise) to 0 (data), and the
denoiser predicts the velocity `v = noise - x0`.

The ODE `dx = v dt` maps noise to data deterministically. Flow-GRPO turns it into an SDE
with the same marginals, so that each step is a Gaussian policy with a log-probability:

    dx = [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] dt + sigma_t dw,
    sigma_t = eta * sqrt(t / (1 - t)),

which one Euler-Maruyama step from `t` to `t_next < t` makes

    x_next ~ N(mean, std^2 I),  mean = x + dt * [v + sigma_t^2 / (2 t) (x + (1 - t) v)],
    std = sigma_t * sqrt(-dt),  dt = t_next - t.

At `t = 1` `sigma_t` is infinite; the first step uses the grid's second time there, as
Flow-GRPO does. `eta = 0` is the ODE step. On this path the deterministic DDIM step
(predict `x0 = x - t v` and the noise `x + (1 - t) v`, then mix them at `t_next`) is the
same Euler step, `x + (t_next - t) v`: one ODE sampler serves for both. Everything here is plain torch, on any device
and dtype; the log-probability sums over a sample's dimensions (`logprob_of`)."""

from __future__ import annotations

import math

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def time_grid(steps: int, shift: float = 1.0) -> list[float]:
    """`steps + 1` times from 1 to 0, evenly spaced, then shifted toward the noisy end by
    `shift` (t' = shift t / (1 + (shift - 1) t), as SD3's schedulers; 1 leaves them)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    grid = [1.0 - index / steps for index in range(steps + 1)]
    return [shift * t / (1.0 + (shift - 1.0) * t) for t in grid]


def noise_level(t: float, t_next: float, eta: float) -> float:
    """The SDE's `sigma_t` at `t` (its value at the next grid time when `t` is 1)."""
    if eta == 0.0:
        return 0.0
    at = t if t < 1.0 else t_next
    return eta * math.sqrt(at / (1.0 - at))


def step_distribution(
    x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, eta: float
) -> tuple[torch.Tensor, float]:
    """The mean and standard deviation of `x_next` given `x` at `t` and the velocity `v`
    predicted there (the module docstring's formula); std 0 when `eta` is 0."""
    dt = t_next - t
    sigma = noise_level(t, t_next, eta)
    if sigma == 0.0:
        return x + dt * v, 0.0
    drift = v + (sigma * sigma / (2.0 * t)) * (x + (1.0 - t) * v)
    return x + dt * drift, sigma * math.sqrt(-dt)


def logprob_of(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """[B] log-density of each `x_next` under N(mean, std^2 I), summed over its dimensions
    (in float64 when the inputs are, else float32)."""
    if std <= 0.0:
        raise ValueError("a deterministic step has no log-probability (eta is 0)")
    dtype = torch.float64 if x_next.dtype == torch.float64 else torch.float32
    z = (x_next.to(dtype) - mean.to(dtype)) / std
    per_dim = -0.5 * z * z - math.log(std) - LOG_SQRT_2PI
    return per_dim.flatten(1).sum(dim=1)


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    t: float,
    t_next: float,
    eta: float,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SDE step driven by the standard normal `noise` (the caller draws it, from each
    sample's own generator): `(x_next, [B] log-probability of x_next)`."""
    mean, std = step_distribution(x, v, t, t_next, eta)
    x_next = mean + std * noise
    return x_next, logprob_of(x_next, mean, std)


def ode_step(x: torch.Tensor, v: torch.Tensor, t: float, t_next: float) -> torch.Tensor:
    """One Euler step of the ODE from `t` to `t_next`."""
    return x + (t_next - t) * v


def predicted_clean(x: torch.Tensor, v: torch.Tensor, t: float) -> torch.Tensor:
    """The clean sample the velocity `v` at `t` points to: x0 = x - t v."""
    return x - t * v
