"""The student of ODE trajectory distillation (`rollwire ode-distill`, after its pairs phase
in `rollwire.services.app.ode_distill`): a flow denoiser that learns to predict, from a node
of the teacher's ODE trajectory and its time, the trajectory's end in one step.

Rows are (trajectory, node) pairs of the training trajectories (`ode_distill.data`; the
held-out trajectories are `held_out_fraction` of them by `seed`, or those of the pairs
folder `eval_data`). A step takes `batch_size` rows and one optimizer update of
`diffusion.distill.ode_distill_loss` (`ODEDistillStep`, split over the ranks as the
diffusion steps are), on the trainer section's backend, precision, LoRA and optimizer,
with checkpoints and resume as the other pipelines.

Every evaluation (before the first step, every `eval_every`, after the last) writes to
`metrics/ode-distill.jsonl`: the held-out loss, and for each of `eval_steps` the judge's
measures (`diffusion.judge.SampleQuality`: accuracy for the class asked, Frechet distance
to real digits, within-class diversity relative to real digits) of `eval_per_class`
samples of each class from held-out noise seeds, sampled by the student in that many
steps (`few_step_sample`, re-noising `renoise`). The teacher's measures at its own
`teacher_steps`, on the same seeds, are taken once (`metrics/ode-distill-teacher.json`),
and each student row carries its Frechet ratio to them; a student whose distance passes
twice its own best in the run, or whose diversity falls under half its best, is named on
the console.
The curves go to `metrics/ode_distill.png`, and a grid of each step count's samples to
`metrics/images/`.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import RunConfig
from rollwire.services.core.files import read_jsonl
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.pipelines.common import run_pipeline, split_data, train_steps

FAMILY = "rollwire.trainer.models.flow_denoiser:FlowDenoiser"
COLLAPSE_FRECHET = 2.0
"""A student's Frechet distance above this times the best it reached in the run is
reported on the console as a collapse."""
COLLAPSE_DIVERSITY = 0.5
"""So is a diversity below this times its best."""

Row = tuple[np.ndarray, float, int, np.ndarray]
"""(the node's latent [C, H, W], its time, the class, the trajectory's end [C, H, W])."""


class _Counts:
    def __init__(self, trajectories: int, rows: int) -> None:
        self.trajectories, self.rows = trajectories, rows

    def summary(self) -> str:
        return f"{self.trajectories} teacher trajectories, {self.rows} (node, end) rows"


def _rows(pairs: Any, trajectories: list[int]) -> list[Row]:
    return [
        (pairs.latents[i, k], float(time_), int(pairs.labels[i]), pairs.clean[i])
        for i in trajectories
        for k, time_ in enumerate(pairs.times)
    ]


def prepare(config: RunConfig, model_path: Path) -> tuple[list[Row], list[Row], dict[str, Any]]:
    """(training rows, held-out rows, what was read)."""
    from rollwire.diffusion.ode_pairs import load_pairs

    ode = config.ode_distill
    loaded: dict[Path, Any] = {}

    def build(folder: Path) -> tuple[list[int], _Counts]:
        pairs = load_pairs(folder, ode.pairs if folder == ode.data else None)
        loaded[folder] = pairs
        return list(range(len(pairs))), _Counts(len(pairs), len(pairs) * len(pairs.times))

    train, held, report = split_data("ode_distill", ode, build, "trajectories")
    held_pairs = loaded[ode.eval_data] if ode.eval_data is not None else loaded[ode.data]
    return _rows(loaded[ode.data], train), _rows(held_pairs, held), report


def _stack(rows: list[Row]) -> tuple[torch.Tensor, ...]:
    x, t, labels, clean = zip(*rows, strict=True)
    return (
        torch.from_numpy(np.stack(x)),
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(labels, dtype=torch.long),
        torch.from_numpy(np.stack(clean)),
    )


class ODEDistillStep:
    """The student's update and its sampling, on every rank (see the module docstring)."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        learner.attach(self, "ode_distill")

    def velocity(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from rollwire.trainer.models.flow_denoiser import Noised

        return self.learner.forward(Noised(x, t, labels)).float()

    def _share(self, count: int) -> list[int]:
        from rollwire.trainer.batching import rank_share

        backend = self.learner.backend
        return rank_share(list(range(count)), backend.rank, backend.world_size)

    @collective
    def step(
        self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, clean: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer update on a batch of rows: the mean of `ode_distill_loss`."""
        return self._loss(x, t, labels, clean, update=True)

    @collective
    def loss(
        self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, clean: torch.Tensor
    ) -> dict[str, float]:
        """The same mean loss without an update (held-out rows)."""
        return self._loss(x, t, labels, clean, update=False)

    def _loss(self, x, t, labels, clean, update: bool) -> dict[str, float]:
        from rollwire.diffusion.distill import ode_distill_loss

        started = time.perf_counter()
        learner, backend = self.learner, self.learner.backend
        device = learner.device
        share = self._share(len(x))
        index = torch.tensor(share or [0])  # a rank without rows runs one that counts for 0
        weight = 1.0 if share else 0.0
        if update:
            backend.zero_grad()
        with torch.enable_grad() if update else torch.no_grad():
            per_sample = ode_distill_loss(
                self.velocity,
                x[index].to(device),
                t[index].to(device),
                labels[index].to(device),
                clean[index].to(device),
            )
            numerator = per_sample.sum() * weight
            if update:
                # The average over ranks of this is the batch's mean loss.
                backend.backward(numerator * (backend.world_size / len(x)))
        summed = backend.reduce_metrics({"loss": float(numerator.detach())}, "sum")
        metrics = {"loss": summed["loss"] / len(x), "rows": float(len(x))}
        if update:
            metrics.update(learner.optimizer_update())
            metrics["step_seconds"] = time.perf_counter() - started
        return metrics

    @collective
    def sample(
        self, noise: torch.Tensor, labels: torch.Tensor, steps: int, renoise: str, seeds: list[int]
    ) -> np.ndarray:
        """The student's samples of `labels` from `noise` in `steps` steps (fresh noise from
        each sample's seed), as [N, C, H, W] numpy."""
        from rollwire.diffusion.distill import few_step_sample, student_times

        device = self.learner.device
        generators = [torch.Generator().manual_seed(int(seed) + 1) for seed in seeds]
        with torch.no_grad():
            images = few_step_sample(
                self.velocity,
                noise.to(device),
                labels.to(device),
                student_times(steps),
                renoise,
                generators,
            )
        return images.float().clamp(-1, 1).cpu().numpy()


def evaluation_noise(per_class: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The held-out evaluation's noise, labels and seeds: `per_class` of each class, each
    from its own seed at `EVAL_SEED_BASE` and up (never a training trajectory's)."""
    from rollwire.diffusion.data import IMAGE_SHAPE
    from rollwire.diffusion.ode_pairs import CLASSES, EVAL_SEED_BASE

    seeds = [EVAL_SEED_BASE + i for i in range(per_class * CLASSES)]
    labels = torch.tensor([i % CLASSES for i in range(len(seeds))])
    noise = torch.stack(
        [torch.randn(IMAGE_SHAPE, generator=torch.Generator().manual_seed(s)) for s in seeds]
    )
    return noise, labels, seeds


def teacher_quality(config: RunConfig, quality: Any) -> tuple[dict[str, float], np.ndarray]:
    """The teacher's measures on the evaluation seeds, sampled by its ODE at
    `teacher_steps` (with its guidance and shift), and the images."""
    from rollwire.diffusion.digits import load_unet, velocity
    from rollwire.diffusion.flow import ode_step, time_grid
    from rollwire.diffusion.sampling import guided
    from rollwire.trainer.models.flow_denoiser import any_label_of

    ode = config.ode_distill
    unet = load_unet(Path(ode.teacher_model_path))
    noise, labels, _ = evaluation_noise(ode.eval_per_class)
    field = guided(
        lambda x, t, y: velocity(unet, x, t, y), ode.guidance, any_label_of(ode.teacher_model_path)
    )
    grid = time_grid(ode.teacher_steps, ode.shift)
    x = noise
    with torch.no_grad():
        for t, t_next in itertools.pairwise(grid):
            x = ode_step(x, field(x, torch.full((len(x),), t), labels), t, t_next)
    images = x.clamp(-1, 1).numpy()
    return quality.measure(images, labels.numpy()), images


def run_student(config: RunConfig, argv: list[str] | None = None) -> int:
    """The student phase: `run_pipeline` with `ODEDistillStep` on the flow denoiser."""
    return run_pipeline(
        config, "ode-distill", config.ode_distill, prepare, _lead, argv, ODEDistillStep, FAMILY
    )


def _lead(
    config: RunConfig,
    step: ODEDistillStep,
    train: list[Row],
    held: list[Row],
    report: dict[str, Any],
    steps: int,
) -> int:
    from rollwire.diffusion.judge import SampleQuality

    ode, run_dir = config.ode_distill, Path(config.run.output_dir)
    for key, value in report.items():
        print(f"{key}: {value}")
    quality = SampleQuality.load()
    teacher, teacher_images = teacher_quality(config, quality)
    floor = quality.floor()
    print(
        f"teacher at {ode.teacher_steps} steps: frechet {teacher['frechet']:.2f}, diversity "
        f"{teacher['diversity']:.2f}, accuracy {teacher['accuracy']:.3f} (held-out real "
        f"digits: frechet {floor['frechet']:.2f})"
    )
    record = run_dir / "metrics" / "ode-distill-teacher.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(
        json.dumps({"teacher_steps": ode.teacher_steps, "teacher": teacher, "real": floor}) + "\n"
    )
    noise, labels, seeds = evaluation_noise(ode.eval_per_class)
    warned: set[int] = set()
    best: dict[int, tuple[float, float]] = {}  # step count -> its best (frechet, diversity)
    images_dir = run_dir / "metrics" / "images"

    def evaluate() -> dict[str, float]:
        out: dict[str, float] = {}
        if held:
            total = 0.0
            for start in range(0, len(held), ode.batch_size):
                part = held[start : start + ode.batch_size]
                total += step.loss(*_stack(part))["loss"] * len(part)
            out["eval_loss"] = total / len(held)
        for count in ode.eval_steps:
            images = step.sample(noise, labels, count, ode.renoise, seeds)
            measured = quality.measure(images, labels.numpy())
            for key, value in measured.items():
                out[f"steps{count}_{key}"] = value
            ratio = measured["frechet"] / max(teacher["frechet"], 1e-9)
            out[f"steps{count}_frechet_ratio"] = ratio
            frechet, diversity = best.setdefault(
                count, (measured["frechet"], measured["diversity"])
            )
            best[count] = (min(frechet, measured["frechet"]), max(diversity, measured["diversity"]))
            collapsed = (
                measured["frechet"] > COLLAPSE_FRECHET * frechet
                or measured["diversity"] < COLLAPSE_DIVERSITY * diversity
            )
            if collapsed and count not in warned:
                warned.add(count)
                print(
                    f"student quality collapsed at {count} step(s): frechet "
                    f"{measured['frechet']:.2f} (its best so far {frechet:.2f}), diversity "
                    f"{measured['diversity']:.2f} (best {diversity:.2f})",
                    file=sys.stderr,
                )
            _grid(images[:100], images_dir / f"steps{count}.png")
        return out

    _grid(teacher_images[:100], images_dir / "teacher.png")

    def one(rows: list[int]) -> dict[str, float]:
        return step.step(*_stack([train[i] for i in rows]))

    final, path, seconds = train_steps(
        config,
        step.learner,
        "ode-distill",
        ode,
        len(train),
        steps,
        one,
        evaluate,
        lambda metrics: {"loss": f"{metrics['loss']:.4f}"},
    )
    rows = [r for r in read_jsonl(path) if f"steps{ode.eval_steps[0]}_frechet" in r]
    last = rows[-1] if rows else {}
    print(f"{steps} steps in {seconds:.0f} s")
    for count in ode.eval_steps:
        key = f"steps{count}_frechet"
        if key in last:
            print(
                f"student at {count} step(s): frechet {last[key]:.2f} "
                f"({last[f'steps{count}_frechet_ratio']:.2f}x the teacher's "
                f"{teacher['frechet']:.2f}), diversity {last[f'steps{count}_diversity']:.2f}, "
                f"accuracy {last[f'steps{count}_accuracy']:.3f}"
            )
    plot = _plot(path, ode.eval_steps, teacher)
    print(f"model: {final}\nmetrics: {path}" + (f"\nplot: {plot}" if plot else ""))
    return 0


def _grid(images: np.ndarray, path: Path) -> None:
    """Up to 100 images as a 10-wide grid, one class a column (the evaluation's order)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    count = len(images) - len(images) % 10
    tiles = ((images[:count, 0] + 1) * 127.5).clip(0, 255).astype(np.uint8)
    tiles = np.pad(tiles, ((0, 0), (1, 1), (1, 1)), constant_values=64)  # a grey frame each
    size = tiles.shape[-1]
    rows = tiles.reshape(-1, 10, size, size).transpose(0, 2, 1, 3).reshape(-1, 10 * size)
    Image.fromarray(rows).resize((rows.shape[1] * 4, rows.shape[0] * 4), Image.NEAREST).save(path)


def _plot(path: Path, eval_steps: list[int], teacher: dict[str, float]) -> Path | None:
    """The Frechet distance and diversity of each step count by training step, with the
    teacher's as lines, to `metrics/ode_distill.png`."""
    rows = [r for r in read_jsonl(path) if f"steps{eval_steps[0]}_frechet" in r]
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
    out = path.with_name("ode_distill.png")
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out
