"""Flow-GRPO on the built-in digits model, in one process: the diffusion engine samples,
the reward-server's `digit` scorer judges, Flow-GRPO's step trains, weights go back to the
engine after every update. What a `rollwire train` of a diffusion task does across
services, without them, to see the learning and its over-optimisation quickly.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flow_grpo.py [--iterations 200]
        [--target 3] [--prompt any] [--kl 0] [--seed 0] [--plot curve.png]

Every iteration samples `--groups` groups of `--group-size` images of `--prompt` (by
default the unconditional branch, "any digit") with the SDE on the recorded window, pays
each the judge's probability that it is the digit `--target`, and takes one update. Every
`--eval-every` iterations, 200 held-out seeds (never trained on) are sampled by the ODE and
judged: the share the judge reads as the target, the Frechet distance of those samples to
the real held-out images of the target, and their diversity (real held-out 3s: 7.7).

Measured (2026-12-05, seed 0, one thread, 0.38 s an iteration; "any" -> 3):

| settings | share at 0 / 100 / 200 | Frechet at 0 / best (iteration) / 200 | diversity at 0 / 200 |
|---|---|---|---|
| lr 3e-4 | 0.10 / 1.00 / 1.00 | 124.4 / 15.1 (20) / 67.9 | 12.5 / 2.9 |
| lr 5e-5 | 0.10 / 0.93 / 1.00 | 124.4 / 12.2 (120) / 24.5 | 12.5 / 3.8 |
| lr 5e-5, KL 0.05 | 0.10 / 0.69 / 0.98 | 124.4 / 8.4 (160) / 9.9 | 12.5 / 5.7 |

The reward is reached in every row; what differs is what the samples become: at the
higher rate one stroke pattern of a 3 (the Frechet distance climbs back as diversity
falls: over-optimisation), with the KL to the starting model the 3s stay varied longer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from rollwire.diffusion.data import digits
from rollwire.diffusion.digits import digits_model
from rollwire.diffusion.judge import digits_judge, diversity, frechet_distance
from rollwire.diffusion.sampling import SamplingSettings
from rollwire.diffusion.trajectories import latent_trajectory
from rollwire.reward.images import digit_score
from rollwire.reward.scorers import ScoreInput
from rollwire.rollout.server.diffusion_engine import DiffusionEngine, ImageRequest
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import array_bytes
from rollwire.trainer.learner import Learner
from rollwire.trainer.models.flow_denoiser import FlowDenoiser
from rollwire.trainer.rl.flow_grpo import FlowGRPOStep

EVAL_SEEDS = list(range(10**6, 10**6 + 200))
"""Held-out seeds: training draws its seeds below 10**6."""


async def evaluate(engine, args, judge, real_features) -> dict[str, float]:
    requests = [ImageRequest(f"eval-{seed}", args.prompt, seed) for seed in EVAL_SEEDS]
    out = await engine.generate_images(requests, SamplingSettings(steps=args.steps))
    images = np.clip(np.stack([g.image for g in out]), -1, 1)
    probabilities = judge.probabilities(images)
    features = judge.features(images)
    return {
        "share": float((probabilities.argmax(axis=1) == args.target).mean()),
        "probability": float(probabilities[:, args.target].mean()),
        "frechet": frechet_distance(features, real_features),
        "diversity": diversity(features),
    }


async def run(args) -> list[dict]:
    folder = digits_model(threads=torch.get_num_threads())
    judge = digits_judge()
    held, labels = digits("held_out")
    real_features = judge.features(held[labels == args.target])
    engine = DiffusionEngine(folder, max_batch_size=args.groups * args.group_size)
    await engine.start()
    config = TrainerConfig(
        optimizer={"learning_rate": args.learning_rate},
        algorithm={
            "kl": {"coef": args.kl},
            "loss": {"type": "ppo_clip", "clip_low": args.clip, "clip_high": args.clip},
        },
    )
    learner = Learner(folder, config, family=FlowDenoiser())
    rl = RLSection(group_size=args.group_size, max_steps=args.iterations)
    step = FlowGRPOStep(learner, config, rl)
    window = (0, args.steps - 1) if args.window is None else tuple(args.window)
    settings = SamplingSettings(steps=args.steps, eta=args.eta, sde_window=window)
    rng = np.random.default_rng(args.seed)
    rows, started = [], time.monotonic()
    try:
        for iteration in range(args.iterations + 1):
            if iteration % args.eval_every == 0:
                row = {"iteration": iteration, **await evaluate(engine, args, judge, real_features)}
                row["seconds"] = round(time.monotonic() - started, 1)
                rows.append(row)
                print(
                    f"| {iteration} | {row['share']:.3f} | {row['probability']:.3f} "
                    f"| {row['frechet']:.2f} | {row['diversity']:.2f} | {row['seconds']:.0f} |",
                    flush=True,
                )
            if iteration == args.iterations:
                break
            seeds = rng.integers(0, 10**6, size=args.groups).tolist()
            requests = [
                ImageRequest(f"i{iteration}-{g}-{s}", args.prompt, seeds[g] * 1000 + s)
                for g in range(args.groups)
                for s in range(args.group_size)
            ]
            generations = await engine.generate_images(requests, settings)
            trajectories = []
            for index, generation in enumerate(generations):
                item = ScoreInput(
                    response="", reference=str(args.target), image=array_bytes(generation.image)
                )
                reward = digit_score(item).reward
                group = iteration * args.groups + index // args.group_size
                trajectories.append(
                    latent_trajectory(
                        generation,
                        trajectory_id=f"i{iteration}-{index}",
                        group_id=f"g{group}",
                        sample_index=index % args.group_size,
                        prompt_ordinal=group,
                        task_id=args.prompt,
                        source="digits",
                        domain="digit",
                        settings=settings,
                        reward=reward,
                    )
                )
            step.step(trajectories)
            weights = {name: tensor.detach().clone() for name, tensor in learner.named_weights()}
            await engine.update_weights(weights, iteration + 1)
    finally:
        await engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=int, default=3)
    parser.add_argument("--prompt", default="any")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eta", type=float, default=0.7)
    parser.add_argument("--window", type=int, nargs=2, default=None, help="SDE steps [a, b)")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the model build's progress
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    print(
        f"Flow-GRPO: '{args.prompt}' -> judged '{args.target}', {args.groups} x "
        f"{args.group_size} samples an iteration, {args.steps} steps, eta {args.eta}, "
        f"lr {args.learning_rate}, KL {args.kl}, seed {args.seed}\n"
    )
    print("| iteration | judged share | P(target) | Frechet to real | diversity | seconds |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot is not None:
        plot(args.plot, rows, args)
        print(f"\nwrote {args.plot}")


def plot(path: Path, rows: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations = [row["iteration"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(iterations, [row["share"] for row in rows], marker="o", label="judged share")
    left.plot(iterations, [row["probability"] for row in rows], marker=".", label="P(target)")
    left.set_xlabel("iteration")
    left.set_ylim(0, 1)
    left.legend()
    left.set_title(f"held-out reward ('{args.prompt}' -> {args.target})")
    right.plot(iterations, [row["frechet"] for row in rows], marker="o", color="C3")
    right.set_xlabel("iteration")
    right.set_ylabel("Frechet distance to real")
    right.set_title("sample quality (lower is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
