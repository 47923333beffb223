"""How the diffusion distillation pipelines (`rollwire ode-distill`, `rollwire dmd`) measure
their few-step students, one implementation for both.

Every evaluation samples the student at each of its `eval_steps` step counts for
`per_class` held-out noise seeds of each class (`evaluation_noise`: seeds from
`EVAL_SEED_BASE` up, never a training trajectory's or sample's) and measures the samples
with the digits judge (`diffusion.judge.SampleQuality`): accuracy for the class asked,
the Frechet distance to real digits in the judge's features, within-class diversity
relative to real digits. The teacher's measures at its own step count, on the same seeds,
are taken once (`metrics/<command>-teacher.json`) and each student row carries its
Frechet ratio to them. Ratios want many samples: a Frechet distance from N samples reads
high by a term that shrinks with N and is alike for every model, so with few samples
every ratio crowds toward 1 (the built-in teacher reads 0.93 at 50 a class, 0.36 at 200,
and an ODE student 1.14x the one, 1.48x the other). A student whose distance passes twice its best in the run, or
whose diversity falls under half its best, is named on the console: a distillation run
that diverges says so rather than logging losses that look fine. Each evaluation also
writes a grid of each step count's samples (`metrics/images/steps<n>.png`, one digit a
column) and the run's curves (`metrics/<command>.png`).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.files import read_jsonl

COLLAPSE_FRECHET = 2.0
"""A student's Frechet distance above this times the best it reached in the run is
reported on the console as a collapse."""
COLLAPSE_DIVERSITY = 0.5
"""So is a diversity below this times its best."""

Sampler = Callable[[torch.Tensor, torch.Tensor, int, list[int]], np.ndarray]
"""`sample(noise, labels, steps, seeds) -> [N, C, H, W]` images of the student."""


def evaluation_noise(
    per_class: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The held-out evaluation's noise, labels and seeds: `per_class` of each class, each
    from its own seed at `EVAL_SEED_BASE + offset` and up (the runs' own: offset 0)."""
    from rollwire.diffusion.data import IMAGE_SHAPE
    from rollwire.diffusion.ode_pairs import CLASSES, EVAL_SEED_BASE

    if offset < 0:
        raise ValueError(f"the seed offset cannot be negative, got {offset}")
    seeds = [EVAL_SEED_BASE + offset + i for i in range(per_class * CLASSES)]
    labels = torch.tensor([i % CLASSES for i in range(len(seeds))])
    noise = torch.stack(
        [torch.randn(IMAGE_SHAPE, generator=torch.Generator().manual_seed(s)) for s in seeds]
    )
    return noise, labels, seeds


def student_samples(
    velocity: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    renoise: str,
    seeds: list[int],
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """A few-step student's samples of `labels` from `noise` in `steps` steps, as every
    evaluation takes them: the fresh noise between steps drawn from each sample's seed + 1,
    the images clamped to [-1, 1], as [N, C, H, W] numpy."""
    from rollwire.diffusion.distill import few_step_sample, student_times

    generators = [torch.Generator().manual_seed(int(seed) + 1) for seed in seeds]
    with torch.no_grad():
        images = few_step_sample(
            velocity,
            noise.to(device),
            labels.to(device),
            student_times(steps),
            renoise,
            generators,
        )
    return images.float().clamp(-1, 1).cpu().numpy()


def teacher_samples(
    teacher: Path, steps: int, guidance: float, shift: float, per_class: int, offset: int = 0
) -> np.ndarray:
    """The teacher's ODE samples (`steps` Euler steps, its guidance and shift) from the
    evaluation's noise (`evaluation_noise(per_class, offset)`)."""
    from rollwire.diffusion.digits import load_unet, velocity
    from rollwire.diffusion.flow import ode_step, time_grid
    from rollwire.diffusion.sampling import guided
    from rollwire.trainer.models.flow_denoiser import any_label_of

    unet = load_unet(Path(teacher))
    noise, labels, _ = evaluation_noise(per_class, offset)
    field = guided(lambda x, t, y: velocity(unet, x, t, y), guidance, any_label_of(teacher))
    x = noise
    with torch.no_grad():
        for t, t_next in itertools.pairwise(time_grid(steps, shift)):
            x = ode_step(x, field(x, torch.full((len(x),), t), labels), t, t_next)
    return x.clamp(-1, 1).numpy()


class StudentQuality:
    """One run's evaluations of its student (see the module docstring); rank 0 only."""

    def __init__(
        self,
        run_dir: Path,
        command: str,
        teacher: Path,
        teacher_steps: int,
        guidance: float,
        shift: float,
        eval_steps: list[int],
        per_class: int,
    ) -> None:
        from rollwire.diffusion.judge import SampleQuality

        self.run_dir, self.command, self.eval_steps = run_dir, command, eval_steps
        self.judge = SampleQuality.load()
        self.noise, self.labels, self.seeds = evaluation_noise(per_class)
        images = teacher_samples(teacher, teacher_steps, guidance, shift, per_class)
        self.teacher = self.judge.measure(images, self.labels.numpy())
        real = self.judge.floor()
        print(
            f"teacher at {teacher_steps} steps: frechet {self.teacher['frechet']:.2f}, "
            f"diversity {self.teacher['diversity']:.2f}, accuracy "
            f"{self.teacher['accuracy']:.3f} (held-out real digits: frechet "
            f"{real['frechet']:.2f})"
        )
        record = run_dir / "metrics" / f"{command}-teacher.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(
            json.dumps({"teacher_steps": teacher_steps, "teacher": self.teacher, "real": real})
            + "\n"
        )
        self.images_dir = run_dir / "metrics" / "images"
        grid(images[:100], self.images_dir / "teacher.png")
        self.best: dict[int, tuple[float, float]] = {}
        """Each step count's best (frechet, diversity) so far in this process."""
        self.warned: set[int] = set()

    def measure(self, sample: Sampler) -> dict[str, float]:
        """`steps<n>_<measure>` of the student's samples at each step count, with its
        Frechet ratio to the teacher; warns of a collapse and writes the grids."""
        out: dict[str, float] = {}
        for count in self.eval_steps:
            images = sample(self.noise, self.labels, count, self.seeds)
            measured = self.judge.measure(images, self.labels.numpy())
            for key, value in measured.items():
                out[f"steps{count}_{key}"] = value
            out[f"steps{count}_frechet_ratio"] = measured["frechet"] / max(
                self.teacher["frechet"], 1e-9
            )
            self._watch(count, measured)
            grid(images[:100], self.images_dir / f"steps{count}.png")
        return out

    def _watch(self, count: int, measured: dict[str, float]) -> None:
        frechet, diversity = self.best.setdefault(
            count, (measured["frechet"], measured["diversity"])
        )
        self.best[count] = (
            min(frechet, measured["frechet"]),
            max(diversity, measured["diversity"]),
        )
        collapsed = (
            measured["frechet"] > COLLAPSE_FRECHET * frechet
            or measured["diversity"] < COLLAPSE_DIVERSITY * diversity
        )
        if collapsed and count not in self.warned:
            self.warned.add(count)
            print(
                f"student quality collapsed at {count} step(s): frechet "
                f"{measured['frechet']:.2f} (its best so far {frechet:.2f}), diversity "
                f"{measured['diversity']:.2f} (best {diversity:.2f})",
                file=sys.stderr,
            )

    def summary(self, path: Path) -> Path | None:
        """Prints the last evaluation's measures against the teacher's and plots the
        run's curves; returns the plot."""
        first = f"steps{self.eval_steps[0]}_frechet"
        rows = [r for r in read_jsonl(path) if first in r]
        last = rows[-1] if rows else {}
        for count in self.eval_steps:
            key = f"steps{count}_frechet"
            if key in last:
                print(
                    f"student at {count} step(s): frechet {last[key]:.2f} "
                    f"({last[f'steps{count}_frechet_ratio']:.2f}x the teacher's "
                    f"{self.teacher['frechet']:.2f}), diversity "
                    f"{last[f'steps{count}_diversity']:.2f}, accuracy "
                    f"{last[f'steps{count}_accuracy']:.3f}"
                )
        return plot(rows, self.eval_steps, self.teacher, path.with_suffix(".png"))


def grid(images: np.ndarray, path: Path) -> None:
    """Up to 100 images as a 10-wide grid, one class a column (the evaluation's order)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    count = len(images) - len(images) % 10
    tiles = ((images[:count, 0] + 1) * 127.5).clip(0, 255).astype(np.uint8)
    tiles = np.pad(tiles, ((0, 0), (1, 1), (1, 1)), constant_values=64)  # a grey frame each
    size = tiles.shape[-1]
    rows = tiles.reshape(-1, 10, size, size).transpose(0, 2, 1, 3).reshape(-1, 10 * size)
    Image.fromarray(rows).resize((rows.shape[1] * 4, rows.shape[0] * 4), Image.NEAREST).save(path)


def plot(
    rows: list[dict[str, Any]], eval_steps: list[int], teacher: dict[str, float], out: Path
) -> Path | None:
    """The Frechet distance and diversity of each step count by training step, with the
    teacher's as lines."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, axis, name in (
        ("frechet", axes[0], "Frechet distance to real digits"),
        ("diversity", axes[1], "within-class diversity (real = 1)"),
    ):
        for count in eval_steps:
            axis.plot(
                [r["step"] for r in rows],
                [r[f"steps{count}_{key}"] for r in rows],
                "o-",
                label=f"student, {count} step(s)",
            )
        axis.axhline(teacher[key], color="black", linestyle="--", label="teacher")
        axis.set_xlabel("step")
        axis.set_title(name, fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out
