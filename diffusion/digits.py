"""The built-in diffusion model: a class-conditional flow-matching UNet on the 8x8 digits
that scikit-learn ships, built offline on first use and cached like the tiny language model.

The data: `data.digits("train")`, 1,500 of scikit-learn's 8x8 digits (the 297 held-out
ones judge samples, never train). The model: a diffusers `UNet2DModel` (164,689
parameters) conditioned on a class label, 0-9 for a digit and 10 for "any digit"
(`ANY`): a tenth of the training labels are replaced by `ANY`, so one model has a
conditional and an unconditional branch. Trained by flow matching (`flow.py`'s
convention: the velocity `noise - x0` at a uniform time), AdamW, one thread by default.

The folder is what diffusers loads: the UNet's `config.json` and weights at its root
(`UNet2DModel.from_pretrained(folder)`, as the trainer saves it), `scheduler/` (a
`FlowMatchEulerDiscreteScheduler`), and `rollwire_diffusion.json` (the image shape, value
range, labels and the build's settings, which key the cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rollwire.diffusion.data import ANY, LABELS, digits
from rollwire.services.core.files import building, cache_dir, staged_directory

log = logging.getLogger(__name__)

MARKER = "rollwire_diffusion.json"


@dataclass(frozen=True)
class DigitsSpec:
    """What makes the built-in model: its shape and its training. Keys the cache."""

    block_out_channels: tuple[int, ...] = (16, 32)
    layers_per_block: int = 1
    attention: bool = False
    """Self-attention in the lowest block (its cost doubles a step; 8x8 does not need it)."""
    norm_num_groups: int = 8
    label_dropout: float = 0.1
    steps: int = 3000
    batch_size: int = 128
    learning_rate: float = 2e-3
    seed: int = 0


def unet_config(spec: DigitsSpec) -> dict[str, Any]:
    """The `UNet2DModel` keyword arguments of `spec`."""
    blocks = len(spec.block_out_channels)
    return {
        "sample_size": 8,
        "in_channels": 1,
        "out_channels": 1,
        "block_out_channels": list(spec.block_out_channels),
        "layers_per_block": spec.layers_per_block,
        "down_block_types": ["DownBlock2D"] * (blocks - 1)
        + ["AttnDownBlock2D" if spec.attention else "DownBlock2D"],
        "up_block_types": ["AttnUpBlock2D" if spec.attention else "UpBlock2D"]
        + ["UpBlock2D"] * (blocks - 1),
        "norm_num_groups": spec.norm_num_groups,
        "num_class_embeds": len(LABELS),
        "attention_head_dim": 8,
    }


def velocity(unet: Any, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The UNet's velocity at times `t` ([B] in [0, 1]; the UNet reads them x 1000, as
    diffusers' schedulers number their timesteps): the one place that convention lives,
    used by training here, the engine and the trainer's family."""
    return unet(x, t * 1000.0, class_labels=labels).sample


def train_flow_matching(
    unet: Any, spec: DigitsSpec, threads: int = 1, progress: bool = True
) -> list[float]:
    """Trains `unet` by flow matching on the training split; returns the loss every 100
    steps (the mean over those steps)."""
    images, labels = digits("train")
    data, classes = torch.from_numpy(images), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / 100) * (1.0 - k / spec.steps)
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    losses, window, started = [], [], time.monotonic()
    try:
        unet.train()
        for step in range(spec.steps):
            index = torch.randint(len(data), (spec.batch_size,), generator=generator)
            x0, label = data[index], classes[index].clone()
            dropped = torch.rand(spec.batch_size, generator=generator) < spec.label_dropout
            label[dropped] = ANY
            noise = torch.randn(x0.shape, generator=generator)
            t = torch.rand(spec.batch_size, generator=generator)
            xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * noise
            loss = torch.nn.functional.mse_loss(velocity(unet, xt, t, label), noise - x0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            window.append(loss.item())
            if (step + 1) % 100 == 0:
                losses.append(sum(window) / len(window))
                window = []
                if progress:
                    elapsed = time.monotonic() - started
                    log.info(
                        "digits model: step %d/%d, loss %.4f, %.0f s",
                        step + 1,
                        spec.steps,
                        losses[-1],
                        elapsed,
                    )
    finally:
        torch.set_num_threads(previous)
        unet.eval()
    return losses


def build_digits_model(
    folder: Path, spec: DigitsSpec = DigitsSpec(), threads: int = 1, progress: bool = True
) -> Path:
    """Trains the built-in model of `spec` and writes its folder (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DModel

    torch.manual_seed(spec.seed)
    unet = UNet2DModel(**unet_config(spec))
    started = time.monotonic()
    losses = train_flow_matching(unet, spec, threads, progress)
    with staged_directory(folder, keep_if_present=MARKER) as staging:
        unet.save_pretrained(staging)
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(
            staging / "scheduler"
        )
        info = {
            "kind": "digits",
            "image_shape": [1, 8, 8],
            "value_range": [-1.0, 1.0],
            "labels": LABELS,
            "any_label": ANY,
            "spec": asdict(spec),
            "losses": losses,
            "seconds": round(time.monotonic() - started, 1),
        }
        (staging / MARKER).write_text(json.dumps(info, indent=1))
    return folder


def digits_model(spec: DigitsSpec = DigitsSpec(), threads: int = 1, progress: bool = True) -> Path:
    """The built-in model of `spec`, trained once into the cache (a folder per spec; a
    second process that wants it meanwhile waits for the first)."""
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / f"digits-flow-{digest}"
    with building(folder, MARKER) as ready:
        if not ready:
            build_digits_model(folder, spec, threads, progress)
    return folder


def load_unet(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The UNet of a model folder, in eval mode."""
    from diffusers import UNet2DModel

    return UNet2DModel.from_pretrained(Path(folder), torch_dtype=dtype).eval()
