"""The built-in diffusion model's quality by sampling steps, judged by the digits judge.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/diffusion_model.py [--train-steps 3000]
        [--per-class 60] [--png samples.png]

Builds (or reads from the cache) the built-in class-conditional flow-matching model
(`rollwire.diffusion.digits`), then for several numbers of ODE steps samples `--per-class`
images of each digit (fixed seeds) and prints, against the 297 held-out digits:
- accuracy: the share of samples the judge reads as the digit asked for;
- Frechet distance of all samples to the held-out digits in the judge's features (as FID);
- within-class diversity: the mean feature distance between two samples of one digit,
  averaged over digits (held-out digits: the "real" row);
and the same for the SDE sampler (eta 0.7 on every step but the last) at the largest step
count. `--png` writes a grid: a row per digit, the samples of each step count side by side.

Measured (2026-12-05, one thread, 3,000 training steps in 233 s; 60 samples a digit):

| sampler | accuracy | Frechet distance | within-class diversity |
|---|---:|---:|---:|
| real (held-out digits) | 0.987 | 0.00 | 8.23 |
| ODE, 1 step | 1.000 | 15.03 | 1.50 |
| ODE, 4 steps | 0.993 | 3.83 | 6.05 |
| ODE, 10 steps | 0.993 | 3.01 | 7.08 |
| ODE, 50 steps | 0.990 | 2.83 | 7.62 |
| SDE eta 0.7, 50 steps | 0.992 | 2.62 | 7.78 |

One step draws each digit's average (judged right, no diversity); the SDE keeps the ODE's
quality, as its marginals are the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from rollwire.diffusion.data import digits
from rollwire.diffusion.digits import DigitsSpec, digits_model, load_unet, velocity
from rollwire.diffusion.judge import digits_judge, diversity, frechet_distance
from rollwire.diffusion.sampling import SamplingSettings, sample


def measures(judge, images: np.ndarray, labels: np.ndarray, held: np.ndarray) -> dict[str, float]:
    features = judge.features(images)
    per_class = [diversity(features[labels == digit]) for digit in range(10)]
    return {
        "accuracy": judge.accuracy(images, labels),
        "frechet": frechet_distance(features, judge.features(held)),
        "diversity": float(np.mean(per_class)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-steps", type=int, default=DigitsSpec().steps)
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--steps", default="1,4,10,50", help="ODE step counts, comma-separated")
    parser.add_argument("--png", type=Path, default=None, help="write a grid of samples here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the build's progress
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.monotonic()
    folder = digits_model(DigitsSpec(steps=args.train_steps), threads=torch.get_num_threads())
    print(f"model: {folder} ({time.monotonic() - started:.0f} s to build or read)")
    unet = load_unet(folder)
    judge = digits_judge()
    held, held_labels = digits("held_out")
    labels = torch.arange(10).repeat_interleave(args.per_class)
    seeds = list(range(len(labels)))

    def field(x: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return velocity(unet, x, t, label)

    rows = [("real (held-out digits)", "", measures(judge, held, held_labels, held), 0.0)]
    grids = []
    counts = [int(count) for count in args.steps.split(",")]
    for count in counts:
        began = time.monotonic()
        out = sample(field, labels, seeds, SamplingSettings(steps=count))
        seconds = time.monotonic() - began
        images = out.images.clamp(-1, 1).numpy()
        rows.append(
            (f"ODE, {count} steps", count, measures(judge, images, labels.numpy(), held), seconds)
        )
        grids.append(images)
    count = counts[-1]
    settings = SamplingSettings(steps=count, eta=0.7, sde_window=(0, count - 1))
    began = time.monotonic()
    out = sample(field, labels, seeds, settings)
    images = out.images.clamp(-1, 1).numpy()
    rows.append(
        (
            f"SDE eta 0.7, {count} steps",
            count,
            measures(judge, images, labels.numpy(), held),
            time.monotonic() - began,
        )
    )
    print(f"\n{args.per_class} samples per digit, judged against {len(held)} held-out digits\n")
    print("| sampler | accuracy | Frechet distance | within-class diversity | seconds |")
    print("|---|---:|---:|---:|---:|")
    for name, _, values, seconds in rows:
        print(
            f"| {name} | {values['accuracy']:.3f} | {values['frechet']:.2f} "
            f"| {values['diversity']:.2f} | {seconds:.1f} |"
        )
    if args.png is not None:
        write_grid(args.png, grids, counts, args.per_class)
        print(f"\nwrote {args.png}")


def write_grid(path: Path, grids: list[np.ndarray], counts: list[int], per_class: int) -> None:
    """A row per digit; for each step count, its first 6 samples of that digit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = min(6, per_class)
    figure, axes = plt.subplots(10, len(grids), figsize=(1.6 * shown * len(grids) / 3, 10))
    for column, (images, count) in enumerate(zip(grids, counts, strict=True)):
        for digit in range(10):
            row = images[digit * per_class : digit * per_class + shown, 0]
            axes[digit, column].imshow(
                np.concatenate(list(row), axis=1), cmap="gray_r", vmin=-1, vmax=1
            )
            axes[digit, column].set_xticks([])
            axes[digit, column].set_yticks([])
        axes[0, column].set_title(f"{count} step{'s' if count > 1 else ''}")
    figure.tight_layout()
    figure.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
