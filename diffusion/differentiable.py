"""Image rewards in torch, with a gradient: what reward feedback learning maximises.

Each domain of the reward-server's image scorers (`rollwire.reward.images`) that can be
written as a differentiable function of the pixels has a twin here, paying what the
reward-server pays for the same image (to float32 rounding; `DIFFERENTIABLE` lists them):

- `digit`: the digits judge's probability of the wanted digit (`TorchJudge`, the same
  weights as the numpy judge); `metadata.pay: correct` is a step function, no gradient;
- `brightness`, `contrast`, `colour`: as the reward-server computes them.

`differentiable_reward(domain)` gives the twin: `reward(images, references, metadata)`
with images [B, C, H, W] in [-1, 1] (clamped there first, as the engine clips what it
sends to be scored), one reference and one metadata dict per image; [B] rewards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from rollwire.diffusion.judge import DigitsJudge

DifferentiableReward = Callable[[torch.Tensor, list[str], list[dict[str, Any]]], torch.Tensor]


class TorchJudge(torch.nn.Module):
    """The digits judge in torch: the numpy `DigitsJudge`'s weights (float32, frozen)."""

    def __init__(self, judge: DigitsJudge) -> None:
        super().__init__()
        for name in ("w1", "b1", "w2", "b2"):
            self.register_buffer(name, torch.as_tensor(getattr(judge, name), dtype=torch.float32))
        self.requires_grad_(False)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 10] logits of [B, 1, 8, 8] images."""
        flat = images.reshape(len(images), -1).to(self.w1.dtype)
        return torch.relu(flat @ self.w1 + self.b1) @ self.w2 + self.b2

    def log_probability(self, images: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
        """[B] log-probability that each image is its digit in `digits` ([B] ints)."""
        log_probs = torch.log_softmax(self.logits(images), dim=1)
        return log_probs.gather(1, digits.long().view(-1, 1)).squeeze(1)


class DigitReward:
    """The `digit` domain's twin (see the module docstring); the judge is read from the
    cache (fitted there first if it is not yet) on first use."""

    def __init__(self, judge: DigitsJudge | None = None) -> None:
        self._judge = TorchJudge(judge) if judge is not None else None

    def __call__(
        self, images: torch.Tensor, references: list[str], metadata: list[dict[str, Any]]
    ) -> torch.Tensor:
        if tuple(images.shape[1:]) != (1, 8, 8):
            raise ValueError(f"the digit domain scores 1x8x8 images, not {list(images.shape[1:])}")
        wanted = []
        for reference, extra in zip(references, metadata, strict=True):
            reference = reference.strip()
            if len(reference) != 1 or not reference.isdigit():
                raise ValueError(f"the digit domain needs a reference digit 0-9, got {reference!r}")
            if extra.get("pay", "probability") != "probability":
                raise ValueError(
                    f"the digit domain's pay: {extra.get('pay')!r} has no gradient; reward "
                    "feedback learning needs pay: probability"
                )
            wanted.append(int(reference))
        if self._judge is None:
            from rollwire.diffusion.judge import digits_judge

            self._judge = TorchJudge(digits_judge())
        judge = self._judge.to(images.device)
        digits = torch.tensor(wanted, device=images.device)
        return judge.log_probability(images.clamp(-1.0, 1.0), digits).exp()


def brightness_reward(images: torch.Tensor, references: list[str], metadata: list) -> torch.Tensor:
    return (images.clamp(-1.0, 1.0).flatten(1).mean(dim=1) + 1.0) / 2.0


def contrast_reward(images: torch.Tensor, references: list[str], metadata: list) -> torch.Tensor:
    return images.clamp(-1.0, 1.0).flatten(1).std(dim=1, unbiased=False).clamp(max=1.0)


def colour_reward(
    images: torch.Tensor, references: list[str], metadata: list[dict[str, Any]]
) -> torch.Tensor:
    channels = images.shape[1]
    targets = []
    for extra in metadata:
        target = extra.get("target")
        if not isinstance(target, list) or len(target) != channels:
            raise ValueError(
                f"the colour domain needs metadata.target: {channels} numbers in [-1, 1], "
                f"one per channel, got {target!r}"
            )
        targets.append([float(v) for v in target])
    mean = images.clamp(-1.0, 1.0).mean(dim=(2, 3))
    distance = (mean - torch.tensor(targets, dtype=mean.dtype, device=mean.device)).norm(dim=1)
    return 1.0 - distance / (2.0 * math.sqrt(channels))


DIFFERENTIABLE: dict[str, Callable[[], DifferentiableReward]] = {
    "digit": DigitReward,
    "brightness": lambda: brightness_reward,
    "contrast": lambda: contrast_reward,
    "colour": lambda: colour_reward,
}
"""domain -> a maker of its differentiable twin."""


def differentiable_reward(domain: str) -> DifferentiableReward:
    """The twin of `domain`'s scorer; ValueError for a domain without one."""
    if domain not in DIFFERENTIABLE:
        raise ValueError(
            f"the {domain!r} domain has no differentiable twin for reward feedback learning "
            f"(these have: {', '.join(sorted(DIFFERENTIABLE))})"
        )
    return DIFFERENTIABLE[domain]()
