"""Sampling a flow-matching denoiser in batches, each sample from its own seed, by the ODE
or by the SDE in a window of steps that are recorded for RL (`flow.py` has the math).

`sample(velocity, labels, seeds, settings)` runs `settings.steps` steps from noise at t = 1
to t = 0. Steps whose index is in `settings.sde_window` are recorded: with `settings.eta`
above 0 they are SDE steps, and for each the sample's latent before and after and the
step's log-probability are kept (`Sampled.recorded`), which is what Flow-GRPO trains on;
with `eta` 0 they are ODE steps whose latents are kept (log-probability 0: a
deterministic step has no density), which is where reward feedback learning picks the
sampling up with gradients. Every other step is an ODE step. A sample's noise comes from a generator seeded by its own
seed, so a sample is the same whatever else shares its batch.

`velocity(x, t, labels)` is the denoiser: [B] times in [0, 1]. With `guidance` g != 1
(classifier-free guidance), the velocity is v_any + g (v_label - v_any), `ANY` being the
unconditional label; that costs a second forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollwire.diffusion.flow import logprob_of, ode_step, sde_step, step_distribution, time_grid

Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample; see the module docstring."""

    steps: int = 10
    eta: float = 0.0
    """The SDE's noise level on the recorded steps (0: every step is an ODE step)."""
    sde_window: tuple[int, int] = (0, 0)
    """[first, last) step indices recorded (taken by the SDE when `eta` > 0)."""
    shift: float = 1.0
    guidance: float = 1.0
    any_label: int = 10

    def __post_init__(self) -> None:
        first, last = self.sde_window
        if not 0 <= first <= last <= self.steps:
            raise ValueError(f"sde_window {self.sde_window} must lie within [0, {self.steps}]")
        if self.eta < 0:
            raise ValueError(f"eta must be at least 0, got {self.eta}")
        if self.eta > 0 and last == self.steps:
            raise ValueError(
                "the last step (to t = 0) cannot be an SDE step: its noise level has no limit "
                f"there; end sde_window at {self.steps - 1} at most"
            )

    def recorded_steps(self) -> range:
        return range(*self.sde_window)


@dataclass
class Sampled:
    """A batch's samples and, for each recorded step, what RL needs."""

    images: torch.Tensor
    """[B, C, H, W] at t = 0."""
    times: list[float]
    """The grid, steps + 1 times from 1 to 0."""
    recorded_steps: list[int]
    """The indices of the recorded (SDE) steps, in order."""
    latents: torch.Tensor
    """[B, R + 1, C, H, W]: the latent before each recorded step, then after the last."""
    logprobs: torch.Tensor
    """[B, R] each recorded step's log-probability under the sampling weights."""
    versions: list[int]
    """[R] the policy version whose weights took each recorded step (`version`'s answer
    right after that step's forward; all 0 without one)."""


def guided(velocity: Velocity, guidance: float, any_label: int) -> Velocity:
    """The velocity with classifier-free guidance `guidance` (1: the velocity itself)."""
    if guidance == 1.0:
        return velocity

    def combined(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        both = velocity(
            torch.cat([x, x]),
            torch.cat([t, t]),
            torch.cat([labels, torch.full_like(labels, any_label)]),
        )
        conditional, unconditional = both.chunk(2)
        return unconditional + guidance * (conditional - unconditional)

    return combined


def noise_like(
    shape: tuple[int, ...], generators: list[torch.Generator], dtype: torch.dtype
) -> torch.Tensor:
    """[B, *shape] standard normal noise, row b from `generators[b]`."""
    return torch.stack(
        [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
    ).to(dtype)


@torch.no_grad()
def sample(
    velocity: Velocity,
    labels: torch.Tensor,
    seeds: list[int],
    settings: SamplingSettings,
    shape: tuple[int, ...] = (1, 8, 8),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    version: Callable[[], int] | None = None,
) -> Sampled:
    """Samples `len(seeds)` images (see the module docstring). `version()`, asked right
    after each recorded step's forward, says which weights took it (an engine whose
    weights change between steps)."""
    if len(seeds) != len(labels):
        raise ValueError(f"{len(seeds)} seeds for {len(labels)} labels")
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    field = guided(velocity, settings.guidance, settings.any_label)
    grid = time_grid(settings.steps, settings.shift)
    labels = labels.to(device)
    x = noise_like(shape, generators, dtype).to(device)
    recorded = settings.recorded_steps()
    latents, logprobs, versions = [], [], []
    for index, (t, t_next) in enumerate(itertools.pairwise(grid)):
        v = field(x, torch.full((len(seeds),), t, device=device, dtype=dtype), labels)
        if index in recorded:
            versions.append(0 if version is None else version())
            latents.append(x)
            if settings.eta > 0:
                noise = noise_like(shape, generators, dtype).to(device)
                x, logprob = sde_step(x, v, t, t_next, settings.eta, noise)
            else:
                x, logprob = ode_step(x, v, t, t_next), x.new_zeros(len(seeds))
            logprobs.append(logprob)
        else:
            x = ode_step(x, v, t, t_next)
        if recorded and index == recorded[-1]:
            latents.append(x)
    batch = len(seeds)
    return Sampled(
        images=x,
        times=grid,
        recorded_steps=list(recorded),
        latents=torch.stack(latents, dim=1) if latents else x.new_zeros((batch, 0, *shape)),
        logprobs=torch.stack(logprobs, dim=1) if logprobs else x.new_zeros((batch, 0)),
        versions=versions,
    )


def step_distributions(
    velocity: Velocity,
    latents: torch.Tensor,
    labels: torch.Tensor,
    recorded_steps: list[int],
    settings: SamplingSettings,
) -> list[tuple[torch.Tensor, float]]:
    """For each recorded transition (`Sampled.latents`), the (mean [B, C, H, W], std) of its
    Gaussian under `velocity`, with gradients when they are on: what the trainer
    recomputes with the weights it trains."""
    grid = time_grid(settings.steps, settings.shift)
    field = guided(velocity, settings.guidance, settings.any_label)
    out = []
    for position, index in enumerate(recorded_steps):
        t, t_next = grid[index], grid[index + 1]
        x = latents[:, position]
        v = field(x, torch.full((len(x),), t, device=x.device, dtype=x.dtype), labels)
        out.append(step_distribution(x, v, t, t_next, settings.eta))
    return out


def logprobs_of(
    latents: torch.Tensor, distributions: list[tuple[torch.Tensor, float]]
) -> torch.Tensor:
    """[B, R] log-probabilities of the recorded transitions under `distributions`."""
    return torch.stack(
        [
            logprob_of(latents[:, position + 1].to(mean.device), mean, std)
            for position, (mean, std) in enumerate(distributions)
        ],
        dim=1,
    )


def step_logprobs(
    velocity: Velocity,
    latents: torch.Tensor,
    labels: torch.Tensor,
    recorded_steps: list[int],
    settings: SamplingSettings,
) -> torch.Tensor:
    """[B, R] log-probabilities of recorded transitions under `velocity`."""
    return logprobs_of(
        latents, step_distributions(velocity, latents, labels, recorded_steps, settings)
    )
