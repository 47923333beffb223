"""The student of ODE trajectory distillation (`rollwire ode-distill`, after its pairs phase
in `rollwire.services.app.ode_distill`): a flow denoiser that learns to predict, from a node
of the teacher's ODE trajectory and its time, the trajectory's end in one step.

Rows are (trajectory, node) pairs of the training trajectories (`ode_distill.data`; the
held-out trajectories are `held_out_fraction` of them by `seed`, or those of the pairs
folder `eval_data`). A step takes `batch_size` rows and one optimizer update of
`diffusion.distill.ode_distill_loss` (`ODEDistillStep`, split over the ranks as the
diffusion steps are), on the trainer section's backend, precision, LoRA and optimizer,
with checkpoints and resume as the other pipelines. With `feature_weight` the loss adds
the perceptual distance in the frozen teacher's features (`diffusion.distill.UNetFeatures`),
the teacher loaded beside the student on every rank.

Every evaluation (before the first step, every `eval_every`, after the last) writes to
`metrics/ode-distill.jsonl`: the held-out loss, and the student's sample quality at each
of `eval_steps` (sampled by `few_step_sample`, re-noising `renoise`) against the teacher's
at `teacher_steps` (`student_quality.StudentQuality`: the measures, the collapse warning,
the grids, the curves in `metrics/ode-distill.png`). With `ema_decay` an exponential
moving average of the student (`average.WeightAverage`) is what is sampled there; it is
saved in every checkpoint and as `final_ema`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import RunConfig
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.pipelines.average import WeightAverage
from rollwire.trainer.pipelines.common import run_pipeline, split_data, train_steps

FAMILY = "rollwire.trainer.models.flow_denoiser:FlowDenoiser"

Row = tuple[np.ndarray, float, int, np.ndarray]
"""(the node's latent [C, H, W], its time, the class, the trajectory's end [C, H, W])."""


class _Counts:
    def __init__(self, trajectories: int, rows: int) -> None:
        self.trajectories, self.rows = trajectories, rows

    def summary(self) -> str:
        return f"{self.trajectories} teacher trajectories, {self.rows} (node, end) rows"


def _rows(pairs: Any, trajectories: list[int], kept: list[int]) -> list[Row]:
    """The (node, end) rows of `trajectories` at the node positions `kept`."""
    return [
        (pairs.latents[i, k], float(pairs.times[k]), int(pairs.labels[i]), pairs.clean[i])
        for i in trajectories
        for k in kept
    ]


def prepare(config: RunConfig, model_path: Path) -> tuple[list[Row], list[Row], dict[str, Any]]:
    """(training rows, held-out rows, what was read)."""
    from rollwire.diffusion.ode_pairs import load_pairs

    ode = config.ode_distill
    loaded: dict[Path, Any] = {}

    kept = [k for k, node in enumerate(ode.nodes) if node in (ode.train_nodes or ode.nodes)]

    def build(folder: Path) -> tuple[list[int], _Counts]:
        pairs = load_pairs(folder, ode.pairs if folder == ode.data else None)
        loaded[folder] = pairs
        return list(range(len(pairs))), _Counts(len(pairs), len(pairs) * len(kept))

    train, held, report = split_data("ode_distill", ode, build, "trajectories")
    held_pairs = loaded[ode.eval_data] if ode.eval_data is not None else loaded[ode.data]
    return _rows(loaded[ode.data], train, kept), _rows(held_pairs, held, kept), report


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

    def __init__(
        self,
        learner: Learner,
        ema_decay: float | None = None,
        teacher: Path | None = None,
        feature_weight: float = 0.0,
    ) -> None:
        self.learner, self.feature_weight = learner, feature_weight
        self.features = None
        if feature_weight > 0:
            if teacher is None:
                raise ValueError("ode_distill.feature_weight needs the teacher's folder")
            from rollwire.diffusion.distill import UNetFeatures

            frozen = learner.family.load_frozen(teacher, torch.float32).to(learner.device)
            self.features = UNetFeatures(
                frozen, lambda unet, x, t, labels: self.velocity(x, t, labels, unet)
            )
        self.ema = (
            None
            if ema_decay is None
            else WeightAverage(learner, ema_decay, "ode_distill.ema_decay")
        )
        learner.attach(self, "ode_distill")

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, model: Any = None
    ) -> torch.Tensor:
        """The student's velocity (another module's, such as its EMA, with `model`)."""
        from rollwire.trainer.models.flow_denoiser import Noised

        return self.learner.forward(Noised(x, t, labels), model).float()

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
                self.features,
                self.feature_weight,
            )
            numerator = per_sample.sum() * weight
            if update:
                # The average over ranks of this is the batch's mean loss.
                backend.backward(numerator * (backend.world_size / len(x)))
        summed = backend.reduce_metrics({"loss": float(numerator.detach())}, "sum")
        metrics = {"loss": summed["loss"] / len(x), "rows": float(len(x))}
        if update:
            metrics.update(learner.optimizer_update())
            if self.ema is not None:
                self.ema.update()
            metrics["step_seconds"] = time.perf_counter() - started
        return metrics

    @collective
    def sample(
        self, noise: torch.Tensor, labels: torch.Tensor, steps: int, renoise: str, seeds: list[int]
    ) -> np.ndarray:
        """The student's (its EMA's) samples of `labels` from `noise` in `steps` steps
        (fresh noise from each sample's seed), as [N, C, H, W] numpy."""
        from rollwire.trainer.pipelines.student_quality import student_samples

        model = None if self.ema is None else self.ema.model
        return student_samples(
            lambda x, t, labels: self.velocity(x, t, labels, model),
            noise,
            labels,
            steps,
            renoise,
            seeds,
            self.learner.device,
        )

    def save_state(self, folder: Path, state: dict[str, Any]) -> None:
        if self.ema is not None:
            self.ema.save(folder / "ema")

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        if self.ema is not None:
            self.ema.load(folder / "ema")


def run_student(config: RunConfig, argv: list[str] | None = None) -> int:
    """The student phase: `run_pipeline` with `ODEDistillStep` on the flow denoiser."""
    return run_pipeline(
        config,
        "ode-distill",
        config.ode_distill,
        prepare,
        _lead,
        argv,
        lambda learner: ODEDistillStep(
            learner,
            config.ode_distill.ema_decay,
            config.ode_distill.teacher_model_path,
            config.ode_distill.feature_weight,
        ),
        FAMILY,
    )


def _lead(
    config: RunConfig,
    step: ODEDistillStep,
    train: list[Row],
    held: list[Row],
    report: dict[str, Any],
    steps: int,
) -> int:
    from rollwire.trainer.pipelines.student_quality import StudentQuality

    ode, run_dir = config.ode_distill, Path(config.run.output_dir)
    for key, value in report.items():
        print(f"{key}: {value}")
    quality = StudentQuality(
        run_dir,
        "ode-distill",
        Path(ode.teacher_model_path),
        ode.teacher_steps,
        ode.guidance,
        ode.shift,
        ode.eval_steps,
        ode.eval_per_class,
    )

    def evaluate() -> dict[str, float]:
        out: dict[str, float] = {}
        if held:
            total = 0.0
            for start in range(0, len(held), ode.batch_size):
                part = held[start : start + ode.batch_size]
                total += step.loss(*_stack(part))["loss"] * len(part)
            out["eval_loss"] = total / len(held)
        out.update(
            quality.measure(
                lambda noise, labels, count, seeds: step.sample(
                    noise, labels, count, ode.renoise, seeds
                )
            )
        )
        return out

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
    print(f"{steps} steps in {seconds:.0f} s")
    ema = step.ema.save(run_dir / "final_ema") if step.ema is not None else None
    plot = quality.summary(path)
    print(
        f"model: {final}"
        + (f"\nits EMA (measured above): {ema}" if ema else "")
        + f"\nmetrics: {path}"
        + (f"\nplot: {plot}" if plot else "")
    )
    return 0
