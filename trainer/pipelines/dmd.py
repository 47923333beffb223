"""The generator and the fake score of distribution-matching distillation (`rollwire dmd`,
after `rollwire.services.app.dmd` has started the teacher's rollout-servers).

Where each model lives: the frozen teacher (the real score) is served by diffusion
rollout-servers and asked over `Denoise`, so any number of trainers share it and it runs
on whatever serves it; the two models that train, the generator (this run's `Learner`:
trainer.model_path, else the teacher) and the fake score (a second learner, the teacher
to start), stay together in the trainer, because every generator update needs the fake
score's prediction with gradients flowing through the sample, and the fake score trains
on the generator's fresh samples.

A step (`DMDStep.step`), from its own seed (`run.seed` and the step's number: a resumed
run draws what an unbroken one would):
1. `fake_updates` times: a batch of the generator's samples (no gradient), each diffused
   to a uniform time in `time_range`, and one update of the fake score by flow matching
   on them (`diffusion.distill.flow_matching_loss`); with `gan_weight`, the GAN head on
   the fake score's middle features learns real training digits from these samples
   (`gan_head_loss`) in the same update.
2. One generator update: new samples with gradient, diffused to times in `time_range`;
   the teacher's clean predictions of them (one `Denoise` call, with `guidance`) and the
   fake score's; the DMD direction (`dmd_direction`) through `dmd_generator_loss`, plus
   `gan_weight` times the generator's GAN loss; then the EMA (`ema_decay`).
With `student_steps` above 1 the generator samples in that many steps
(`student_times`); each batch trains one of them, chosen at random, on the input the
generator's earlier steps make without gradient (backward simulation). With a list of
step counts, each batch first draws which schedule it trains.

Evaluation and checkpoints: `student_quality.StudentQuality` at every `eval_every` (the
EMA's samples when there is one); a checkpoint holds the generator (the learner's folder,
optimizer, schedule and RNG), the fake score's folder and optimizer (`fake_score/`), the
GAN head and its optimizer (`gan_head.pt`) and the EMA (`ema/`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import RunConfig
from rollwire.trainer.learner import Learner
from rollwire.trainer.pipelines.average import WeightAverage

FAMILY = "rollwire.trainer.models.flow_denoiser:FlowDenoiser"

RealScore = Callable[[np.ndarray, list[float], list[int]], np.ndarray]
"""`real_score(latents [B, C, H, W], times, labels) -> clean predictions`: the teacher."""


class GanHead(torch.nn.Module):
    """DMD2's discriminator head: a small MLP from the fake score's middle features (read
    with a forward hook on its `mid_block`) to one logit, real vs generated."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(features, 64),
            torch.nn.SiLU(),
            torch.nn.Linear(64, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features.float()).squeeze(-1)


class DMDStep:
    """The fake score, the GAN head and the EMA beside the generator's learner, and a
    step of both (see the module docstring). One rank: `rollwire dmd` runs on the local
    backend."""

    def __init__(self, learner: Learner, config: RunConfig, teacher: Path) -> None:
        from rollwire.trainer.models import family_for

        if learner.sharded:
            raise ValueError(
                "rollwire dmd trains two models in one process: trainer.backend must be "
                "local and trainer.world_size 1"
            )
        dmd = config.dmd
        self.learner, self.dmd, self.run_seed = learner, dmd, config.run.seed
        fake_optimizer = config.trainer.optimizer.model_copy(
            update={
                "learning_rate": dmd.fake_learning_rate or config.trainer.optimizer.learning_rate
            }
        )
        fake_config = config.trainer.model_copy(update={"lora": None, "optimizer": fake_optimizer})
        self.fake = Learner(
            teacher,
            fake_config,
            family_for(FAMILY, teacher, config),
            total_updates=dmd.steps * dmd.fake_updates,
        )
        self.ema = (
            None
            if dmd.ema_decay is None
            else WeightAverage(learner, dmd.ema_decay, "dmd.ema_decay")
        )
        self.head: GanHead | None = None
        self._features: list[torch.Tensor] = []
        self._recording = False
        if dmd.gan_weight > 0:
            self.fake.model.mid_block.register_forward_hook(self._keep_features)
            self.head = GanHead(self._feature_size()).to(self.fake.device)
            self.head_optimizer = torch.optim.AdamW(
                self.head.parameters(), lr=dmd.gan_learning_rate, betas=(0.0, 0.99)
            )
            from rollwire.diffusion.data import digits

            real, labels = digits("train")
            self.real, self.real_labels = torch.from_numpy(real), torch.from_numpy(labels)
        self.real_score: RealScore | None = None
        learner.attach(self, "dmd")

    # ------------------------------------------------------------- the models

    def _keep_features(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        if self._recording:
            self._features.append(output)

    def _feature_size(self) -> int:
        from rollwire.diffusion.data import IMAGE_SHAPE

        with torch.no_grad():
            return (
                self._gan_features(
                    torch.zeros(1, *IMAGE_SHAPE), torch.ones(1), torch.zeros(1, dtype=torch.long)
                )
                .flatten(1)
                .shape[1]
            )

    def _gan_features(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The fake score's middle features of `x` (already diffused to `t`)."""
        self._recording, self._features = True, []
        try:
            self._velocity(self.fake, x, t, labels)
            return self._features[-1]
        finally:
            self._recording, self._features = False, []

    @staticmethod
    def _velocity(learner: Learner, x, t, labels, model: Any = None) -> torch.Tensor:
        from rollwire.trainer.models.flow_denoiser import Noised

        device = learner.device
        return learner.forward(Noised(x.to(device), t.to(device), labels.to(device)), model).float()

    def generator(self, model: Any = None) -> Callable[..., torch.Tensor]:
        """The generator's velocity (its EMA's, or another module's, with `model`)."""
        return lambda x, t, labels: self._velocity(self.learner, x, t, labels, model)

    def _sample(self, noise, labels, draw: torch.Generator, grad: bool) -> torch.Tensor:
        """The generator's sample of one of its steps, chosen by `draw` (backward
        simulation: the earlier steps without gradient)."""
        from rollwire.diffusion.distill import clean_of, few_step_sample, student_times

        schedules = self.dmd.schedules()
        steps = schedules[0]
        if len(schedules) > 1:  # one draw more only then: a single schedule's stream is kept
            steps = schedules[int(torch.randint(len(schedules), (1,), generator=draw))]
        times = student_times(steps)
        last = int(torch.randint(len(times), (1,), generator=draw))
        x = noise
        if last > 0:
            with torch.no_grad():
                _, inputs = few_step_sample(
                    self.generator(),
                    noise,
                    labels,
                    times[: last + 1],
                    self.dmd.renoise,
                    [draw] * len(noise),
                    keep=True,
                )
            x = inputs[-1]
        at = torch.full((len(x),), times[last])
        with torch.enable_grad() if grad else torch.no_grad():
            return clean_of(x, self.generator()(x, at, labels), at)

    def _batch(self, draw: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Labels, noise, diffusion times and their noise of one batch, from `draw`."""
        from rollwire.diffusion.data import IMAGE_SHAPE
        from rollwire.diffusion.ode_pairs import CLASSES

        size, (low, high) = self.dmd.batch_size, self.dmd.time_range
        labels = torch.randint(CLASSES, (size,), generator=draw)
        noise = torch.randn(size, *IMAGE_SHAPE, generator=draw)
        t = low + (high - low) * torch.rand(size, generator=draw)
        eps = torch.randn(size, *IMAGE_SHAPE, generator=draw)
        return labels, noise, t, eps

    def _gan_logits(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head's logits on the fake score's features of `x` (already diffused to t)."""
        return self.head(self._gan_features(x, t, labels))

    # ---------------------------------------------------------------- a step

    def step(self, number: int) -> dict[str, float]:
        """Step `number` (from 1): the fake score's updates, then the generator's."""
        from rollwire.diffusion.distill import (
            clean_of,
            dmd_direction,
            dmd_generator_loss,
            flow_matching_loss,
            gan_generator_loss,
            gan_head_loss,
            noised,
        )
        from rollwire.services.core.seeds import stream_seed

        if self.real_score is None:
            raise RuntimeError("DMDStep.real_score (the teacher) is unset")
        started = time.perf_counter()
        draw = torch.Generator().manual_seed(stream_seed(self.run_seed, "sampling", number))
        metrics: dict[str, float] = {}
        fake_losses, head_losses = [], []
        for _ in range(self.dmd.fake_updates):
            labels, noise, t, eps = self._batch(draw)
            sample = self._sample(noise, labels, draw, grad=False)
            self.fake.backend.zero_grad()
            loss = flow_matching_loss(self._fake_velocity, sample, eps, t, labels).mean()
            if self.head is not None:
                self.head_optimizer.zero_grad(set_to_none=True)
                pick = torch.randint(len(self.real), (len(sample),), generator=draw)
                real_t = noised(self.real[pick], torch.randn_like(sample), t)
                head_loss = gan_head_loss(
                    self._gan_logits(real_t, t, self.real_labels[pick]),
                    self._gan_logits(noised(sample, eps, t), t, labels),
                )
                loss = loss + head_loss
                head_losses.append(float(head_loss.detach()))
            self.fake.backend.backward(loss)
            self.fake.optimizer_update()
            if self.head is not None:
                self.head_optimizer.step()
            fake_losses.append(float(loss.detach()) - (head_losses[-1] if head_losses else 0.0))
        metrics["fake_loss"] = float(np.mean(fake_losses))
        if head_losses:
            metrics["gan_head_loss"] = float(np.mean(head_losses))

        labels, noise, t, eps = self._batch(draw)
        backend = self.learner.backend
        backend.zero_grad()
        sample = self._sample(noise, labels, draw, grad=True)
        diffused = noised(sample.detach(), eps, t)
        asked = time.perf_counter()
        real = torch.from_numpy(
            self.real_score(diffused.cpu().numpy(), t.tolist(), labels.tolist())
        ).to(sample.device)
        metrics["teacher_seconds"] = time.perf_counter() - asked
        with torch.no_grad():
            fake = clean_of(diffused, self._fake_velocity(diffused, t, labels), t)
        direction = dmd_direction(sample, real, fake)
        loss = dmd_generator_loss(sample, direction).mean()
        metrics["dmd_loss"] = float(loss.detach())
        metrics["dmd_direction"] = float(direction.abs().mean())
        if self.head is not None:
            generator_gan = gan_generator_loss(self._gan_logits(noised(sample, eps, t), t, labels))
            metrics["gan_generator_loss"] = float(generator_gan.mean().detach())
            loss = loss + self.dmd.gan_weight * generator_gan.mean()
        backend.backward(loss)
        metrics.update(self.learner.optimizer_update())
        if self.ema is not None:
            self.ema.update()
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics

    def _fake_velocity(self, x, t, labels) -> torch.Tensor:
        return self._velocity(self.fake, x, t, labels)

    def sample(
        self, noise: torch.Tensor, labels: torch.Tensor, steps: int, seeds: list[int]
    ) -> np.ndarray:
        """The generator's (its EMA's) samples of `labels` from `noise` in `steps` steps
        (fresh noise from each sample's seed), as [N, C, H, W] numpy."""
        from rollwire.trainer.pipelines.student_quality import student_samples

        return student_samples(
            self.generator(None if self.ema is None else self.ema.model),
            noise,
            labels,
            steps,
            self.dmd.renoise,
            seeds,
            self.learner.device,
        )

    # ------------------------------------------------------------ checkpoints

    def save_state(self, folder: Path, state: dict[str, Any]) -> None:
        step = int(state["step"])
        self.fake.save_checkpoint(folder / "fake_score", step, step)
        if self.head is not None:
            torch.save(
                {"head": self.head.state_dict(), "optimizer": self.head_optimizer.state_dict()},
                folder / "gan_head.pt",
            )
        if self.ema is not None:
            self.ema.save(folder / "ema")

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        rng = torch.get_rng_state()
        self.fake.restore(folder / "fake_score")
        torch.set_rng_state(rng)
        if self.head is not None:
            saved = torch.load(folder / "gan_head.pt", weights_only=False)
            self.head.load_state_dict(saved["head"])
            self.head_optimizer.load_state_dict(saved["optimizer"])
        if self.ema is not None:
            self.ema.load(folder / "ema")

    def close(self) -> None:
        self.fake.backend.close()


def run_generator(config: RunConfig, teacher: Path, real_score: RealScore) -> int:
    """The trainer's part of `rollwire dmd` (see the module docstring): the generator from
    trainer.model_path, else the teacher."""
    from rollwire.trainer.pipelines.common import become_ranks, pipeline_learner

    dmd = config.dmd
    model_path = Path(config.trainer.model_path or teacher)
    become_ranks(config, "dmd", [])
    try:
        learner = pipeline_learner(config, model_path, dmd.steps, FAMILY)
        try:
            step = DMDStep(learner, config, teacher)
            step.real_score = real_score
            return _lead(config, step, teacher)
        finally:
            learner.close()
    except (ValueError, FileNotFoundError) as error:
        print(f"rollwire dmd: {error}", file=sys.stderr)
        return 1


def _lead(config: RunConfig, step: DMDStep, teacher: Path) -> int:
    from rollwire.trainer.pipelines.common import run_steps
    from rollwire.trainer.pipelines.student_quality import StudentQuality

    dmd, run_dir = config.dmd, Path(config.run.output_dir)
    quality = StudentQuality(
        run_dir,
        "dmd",
        teacher,
        dmd.teacher_steps,
        dmd.guidance,
        1.0,
        dmd.eval_steps,
        dmd.eval_per_class,
    )

    def evaluate() -> dict[str, float]:
        return quality.measure(
            lambda noise, labels, count, seeds: step.sample(noise, labels, count, seeds)
        )

    final, path, seconds = run_steps(
        config,
        step.learner,
        "dmd",
        dmd.steps,
        step.step,
        evaluate,
        lambda metrics: {
            "dmd": f"{metrics['dmd_loss']:.4f}",
            "fake": f"{metrics['fake_loss']:.4f}",
        },
        eval_every=dmd.eval_every,
        checkpoint_every=dmd.checkpoint_every,
    )
    print(f"{dmd.steps} steps in {seconds:.0f} s")
    ema = step.ema.save(run_dir / "final_ema") if step.ema is not None else None
    plot = quality.summary(path)
    print(
        f"generator: {final}"
        + (f"\nits EMA (measured above): {ema}" if ema else "")
        + f"\nmetrics: {path}"
        + (f"\nplot: {plot}" if plot else "")
    )
    return 0
