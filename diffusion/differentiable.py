"""The digits judge in torch, for rewards with a gradient (reward feedback learning).

`TorchJudge(judge)` holds the same weights as the numpy `DigitsJudge` (float32, frozen) and
gives, for [B, 1, 8, 8] images in [-1, 1] with gradients on, the log-probability of each
image being its wanted digit: the `digit` domain's reward, differentiable with respect to
the pixels. It agrees with the reward-server's numpy judge to float32 rounding.
"""

from __future__ import annotations

import torch

from rollwire.diffusion.judge import DigitsJudge


class TorchJudge(torch.nn.Module):
    """See the module docstring."""

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
