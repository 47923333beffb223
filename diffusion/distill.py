"""Distilling the flow-matching teacher into a few-step student: the math of ODE trajectory
distillation and of distribution matching (DMD, DMD2), one implementation for the trainer's
steps and the tests that check it by hand.

Convention as in `flow.py`: `x_t = (1 - t) x0 + t noise`, the denoiser predicts the velocity
`v = noise - x0`, so its clean prediction at `t` is `x0 = x_t - t v` (`clean_of`).

**ODE distillation.** A frozen teacher samples deterministic ODE trajectories from fixed
noise; the latents at chosen nodes and the final clean sample are kept. The student, given
a node's latent `x_t` and its time `t`, predicts the clean sample in one step and is trained
by the mean squared error to the teacher's (`ode_distill_loss`). Optionally a perceptual
distance joins it (`feature_distance`): how far apart the prediction and the teacher's
sample lie in a frozen network's activations (`UNetFeatures`: the teacher's own), each map
scaled to unit length over its channels at every position as LPIPS does. The squared
error alone pays for the average of what the student cannot pin down, a blur; the
distance in features pays for the strokes.

**DMD.** A generator maps noise to a sample in one or a few steps (`few_step_sample`). At a
random time `t` the generated sample `x` is noised again, `x_t = (1 - t) x + t eps`, and two
denoisers predict its clean version: the frozen teacher with guidance ("real score") and a
"fake score" model trained on the generator's own samples. The generator moves along

    grad = (fake_x0 - real_x0) / mean_over_dims |x - real_x0|       (`dmd_direction`)

(the difference of the two scores, normalised per sample so its size does not depend on
how far the sample is), through the loss 1/2 ||x - stopgrad(x - grad)||^2 whose gradient in
`x` is `grad` (`dmd_generator_loss`, averaged over dimensions as DMD's code does). The fake
score is trained by flow matching on the generator's samples (`flow_matching_loss`), more
often than the generator (the two-time-scale rule). DMD2 adds a GAN term on the fake score's
features (a head trained to tell real data from generated samples) and trains a few-step
generator on the times of its own sampling schedule, its inputs made by running the
generator's earlier steps (backward simulation) — the train/inference match that an ODE
student sampled with re-noising lacks.

`few_step_sample` is the student's sampler: predict the clean sample, re-noise it to the
next time with fresh noise (`renoise="fresh"`, DMD2's multi-step sampling) or with the noise
the step implies (`renoise="ddim"`: the deterministic DDIM step, the Euler step of the ODE),
until the last time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`velocity(x, t [B], labels [B]) -> v`, as in `sampling.py`."""

NORMALISER_FLOOR = 1e-6
"""The smallest per-sample normaliser of the DMD direction (a sample on the teacher's own
prediction would divide by 0)."""


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] times shaped to broadcast over [B, ...]."""
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def clean_of(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The clean sample the velocity `v` at times `t` ([B]) points to: x_t - t v."""
    return x_t - _per_sample(t, x_t) * v


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`x0` taken to times `t` ([B]) along `noise`: (1 - t) x0 + t noise."""
    at = _per_sample(t, x0)
    return (1 - at) * x0 + at * noise


def per_sample_mean(values: torch.Tensor) -> torch.Tensor:
    """[B] means of `values` [B, ...] over everything but the batch."""
    return values.flatten(1).mean(dim=1)


Features = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
"""`features(x [B, C, H, W], labels [B]) -> [[B, C_i, H_i, W_i], ...]`: a network's maps."""

UNIT_FLOOR = 1e-8
"""Added to a feature vector's length before dividing by it (an all-zero vector stays 0)."""


def unit_channels(feature: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] activations scaled to unit length over the channels at each position."""
    return feature / (feature.pow(2).sum(dim=1, keepdim=True).sqrt() + UNIT_FLOOR)


def feature_distance(
    features: Features, predicted: torch.Tensor, target: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """[B] the perceptual distance of `predicted` to `target`: for each map of `features`,
    the squared distance of the two unit-scaled activations (`unit_channels`), summed over
    channels and averaged over positions; then averaged over the maps. The target's maps
    are taken without gradient."""
    with torch.no_grad():
        wanted = [unit_channels(f.float()) for f in features(target, labels)]
    got = [unit_channels(f.float()) for f in features(predicted, labels)]
    if not got:
        raise ValueError("features gave no maps")
    distances = [
        (a - b).pow(2).sum(dim=1).flatten(1).mean(dim=1) for a, b in zip(got, wanted, strict=True)
    ]
    return torch.stack(distances).mean(dim=0)


class UNetFeatures:
    """A frozen diffusers UNet's activations of clean images (time 0), the perceptual
    distance's network: the last resnet of every down block and the middle block, read
    by forward hooks. `velocity(unet, x, t, labels)` is the family's call convention."""

    def __init__(self, unet: torch.nn.Module, velocity: Callable[..., torch.Tensor]) -> None:
        self.unet, self.velocity = unet.eval().requires_grad_(False), velocity
        self._maps: list[torch.Tensor] | None = None
        for module in [block.resnets[-1] for block in unet.down_blocks] + [unet.mid_block]:
            module.register_forward_hook(self._keep)

    def _keep(self, _module: Any, _inputs: Any, output: Any) -> None:
        if self._maps is not None:
            self._maps.append(output[0] if isinstance(output, tuple) else output)

    def __call__(self, x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        self._maps = []
        try:
            self.velocity(self.unet, x, torch.zeros(len(x), device=x.device), labels)
            return self._maps
        finally:
            self._maps = None


def ode_distill_loss(
    velocity: Denoiser,
    x_t: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
    teacher_clean: torch.Tensor,
    features: Features | None = None,
    feature_weight: float = 0.0,
) -> torch.Tensor:
    """[B] squared error (mean over dimensions) between the student's one-step clean
    prediction from the teacher's node `x_t` at `t` and the teacher's final sample; with
    `features`, plus `feature_weight` times their `feature_distance`."""
    predicted = clean_of(x_t, velocity(x_t, t, labels), t)
    loss = per_sample_mean((predicted - teacher_clean) ** 2)
    if features is not None and feature_weight > 0:
        loss = loss + feature_weight * feature_distance(features, predicted, teacher_clean, labels)
    return loss


def flow_matching_loss(
    velocity: Denoiser,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """[B] flow matching's loss of `velocity` on clean samples `x0`: the squared error
    (mean over dimensions) of its velocity at `noised(x0, noise, t)` to `noise - x0`. What
    the fake score trains on, with the generator's samples as `x0`."""
    return per_sample_mean((velocity(noised(x0, noise, t), t, labels) - (noise - x0)) ** 2)


def dmd_direction(
    sample: torch.Tensor, real_clean: torch.Tensor, fake_clean: torch.Tensor
) -> torch.Tensor:
    """DMD's update direction on generated `sample`s (see the module docstring): the fake
    score's clean prediction minus the real one, over the mean absolute distance of each
    sample to the real prediction. No gradient flows through it."""
    with torch.no_grad():
        scale = per_sample_mean((sample - real_clean).abs()).clamp(min=NORMALISER_FLOOR)
        return (fake_clean - real_clean) / _per_sample(scale, sample)


def dmd_generator_loss(sample: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """[B] DMD's generator loss, 1/2 mean over dimensions of (sample - stopgrad(sample -
    direction))^2: its gradient in `sample` is `direction` over the dimension count."""
    target = (sample - direction).detach()
    return 0.5 * per_sample_mean((sample - target) ** 2)


def gan_head_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """DMD2's non-saturating GAN loss of the head, from its logits on real data and on
    generated samples (detached from the generator): softplus(-real) + softplus(fake),
    each averaged. Its gradient raises the real logits and lowers the fake ones."""
    softplus = torch.nn.functional.softplus
    return softplus(-real_logits).mean() + softplus(fake_logits).mean()


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """[B] The generator's non-saturating GAN term, softplus(-logit), from the head's logits
    on its live samples: its gradient raises them."""
    return torch.nn.functional.softplus(-fake_logits)


def few_step_sample(
    velocity: Denoiser,
    noise: torch.Tensor,
    labels: torch.Tensor,
    times: Sequence[float],
    renoise: str = "fresh",
    generators: Sequence[torch.Generator] | None = None,
    keep: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
    """The student's sample from `noise` (at `times[0]`, normally 1) through `times`, a
    decreasing schedule above 0: at each time, the clean prediction; then, but after the
    last, that prediction taken to the next time with fresh noise (from `generators`, one
    per sample, or the global generator) or with the noise the step implies (`ddim`).
    `keep`: also return the input of every step (backward simulation's inputs)."""
    if renoise not in ("fresh", "ddim"):
        raise ValueError(f"renoise is fresh or ddim, not {renoise!r}")
    if not times or any(b >= a for a, b in itertools.pairwise(times)):
        raise ValueError(f"times must decrease, got {list(times)}")
    if times[-1] <= 0:
        raise ValueError("the schedule's times must stay above 0 (the last one predicts)")
    x, inputs = noise, []
    for index, t in enumerate(times):
        inputs.append(x)
        at = torch.full((len(x),), float(t), device=x.device, dtype=x.dtype)
        clean = clean_of(x, velocity(x, at, labels), at)
        if index == len(times) - 1:
            return (clean, inputs) if keep else clean
        if renoise == "ddim":
            eps = (x - (1 - t) * clean) / t
        elif generators is not None:
            eps = torch.stack(
                [torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in generators]
            ).to(device=x.device, dtype=x.dtype)
        else:
            eps = torch.randn_like(x)
        x = noised(clean, eps, torch.full_like(at, float(times[index + 1])))
    raise AssertionError("unreachable")


def student_times(steps: int, first: float = 1.0) -> list[float]:
    """A few-step student's schedule: `steps` times evenly from `first` down, above 0
    (1 step: [1]; 2: [1, 0.5]; 4: [1, 0.75, 0.5, 0.25])."""
    if steps < 1:
        raise ValueError(f"a student takes at least one step, got {steps}")
    return [first * (1 - index / steps) for index in range(steps)]


@torch.no_grad()
def ema_update(average: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """`average`'s parameters moved toward `model`'s: a <- decay a + (1 - decay) m."""
    for kept, new in zip(average.parameters(), model.parameters(), strict=True):
        kept.lerp_(new.detach().to(kept.dtype), 1.0 - decay)
