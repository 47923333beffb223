"""Saved few-step students measured on many held-out seeds against their teacher: the
measures of the distillation runs' own evaluations, at a sample count where the
Frechet ratio holds still.

    .venv/bin/python benchmarks/distill_quality.py RUN/final [RUN2/final_ema ...] \\
        [--per-class 1000] [--offset 0] [--steps 1 2 4] [--renoise fresh] [--threads 2]

`rollwire ode-distill` and `rollwire dmd` evaluate on `eval_per_class` seeds a digit
(200 by default): a Frechet distance from that few samples reads high by a term alike for
every model, and moves with the seeds (the teacher read 0.36, 0.43 and 0.34 on three
disjoint sets of 2,000). This takes each student folder (a run's `final`, `final_ema` or a
checkpoint's model) and the teacher (the built-in digits model unless `--teacher`) and
measures both on `--per-class` seeds of each digit, from the evaluation's seed range
(`student_quality.evaluation_noise`; `--offset N` starts N seeds later, so `--offset
10000` with 1,000 a digit is a second set disjoint from the first). With `--offset 0` and
the run's own `eval_per_class` it reproduces the run's last evaluation.

Prints, for the teacher at `--teacher-steps` and each student at each of `--steps`: the
Frechet distance to real digits in the judge's features, its ratio to the teacher's,
within-class diversity relative to real digits, and accuracy for the digit asked.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch

from rollwire.services.core.config import RunConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("students", nargs="+", type=Path, help="student model folders")
    parser.add_argument("--teacher", type=Path, help="default: the built-in digits model")
    parser.add_argument("--per-class", type=int, default=1000)
    parser.add_argument("--offset", type=int, default=0, help="first seed past the base")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--renoise", choices=["fresh", "ddim"], default="fresh")
    defaults = RunConfig().ode_distill
    parser.add_argument("--teacher-steps", type=int, default=defaults.teacher_steps)
    parser.add_argument("--guidance", type=float, default=defaults.guidance)
    parser.add_argument("--shift", type=float, default=defaults.shift)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for folder in args.students:
        if not folder.is_dir():
            raise SystemExit(f"no model folder at {folder}")
    torch.set_num_threads(args.threads)

    from rollwire.diffusion.digits import digits_model, load_unet, velocity
    from rollwire.diffusion.judge import SampleQuality
    from rollwire.trainer.pipelines.student_quality import (
        evaluation_noise,
        student_samples,
        teacher_samples,
    )

    teacher = args.teacher or digits_model(threads=args.threads)
    judge = SampleQuality.load()
    noise, labels, seeds = evaluation_noise(args.per_class, args.offset)
    started = time.perf_counter()
    images = teacher_samples(
        teacher, args.teacher_steps, args.guidance, args.shift, args.per_class, args.offset
    )
    reference = judge.measure(images, labels.numpy())
    real = judge.floor()
    print(
        f"{len(seeds)} samples ({args.per_class} a digit, seeds from offset {args.offset}); "
        f"teacher {teacher} at {args.teacher_steps} steps sampled in "
        f"{time.perf_counter() - started:.0f} s; held-out real digits: frechet {real['frechet']:.3f}\n"
    )
    print("| model | steps | frechet | vs teacher | diversity | accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| teacher | {args.teacher_steps} | {reference['frechet']:.3f} | 1.000x | "
        f"{reference['diversity']:.3f} | {reference['accuracy']:.3f} |"
    )
    for folder in args.students:
        unet = load_unet(folder)
        for steps in args.steps:
            images = student_samples(
                partial(velocity, unet), noise, labels, steps, args.renoise, seeds
            )
            measured = judge.measure(images, labels.numpy())
            ratio = measured["frechet"] / max(reference["frechet"], 1e-9)
            print(
                f"| {folder} | {steps} | {measured['frechet']:.3f} | {ratio:.3f}x | "
                f"{measured['diversity']:.3f} | {measured['accuracy']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
