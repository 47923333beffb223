"""A reward model of the default task, trained with `rollwire reward-model`, then served.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reward_model.py [--pairs 2000] [--steps 300]
        [--serve-steps 30] [--seed 0]

The preference set is built from the default run's task (chain_sum, two terms of one or
two digits), each row's prompt the task's question (what the reward-server hands the
model): for each training prompt the right answer in the response template is preferred
over a wrong one (`--negatives near`: the right answer moved by 1 to 10, up or down;
`mixed`, the default: half of them so, the rest another number, an empty answer or the
number without its tags); the held-out pairs are near misses of the evaluation prompts,
which training never sees. The
model starts from the default run's warmed-up tiny model (its body; the head is new).
The table gives the held-out preference accuracy before training (0.5: a zeroed head
scores every text 0, and a tie counts as wrong; chance is 0.5) and after.

With --serve-steps, a short `rollwire train` then runs with the reward-server's
`reward_model` domain serving the saved folder as the training reward
(orchestrator.dataset.domain: reward_model), while the evaluation stays on the
verifier (reasoning_gym): the table gives its training reward and held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLLWIRE = [sys.executable, "-m", "rollwire.services.app.cli"]


def wrong_answer(right: int, response: str, rng: random.Random, negatives: str) -> str:
    """A wrong response: the right answer moved by 1 to 10 (`near`); with `mixed`, half of
    them so and the rest another number of 0 to 199, an empty answer, or the number
    without the tags (what a policy that games a reward model of near misses writes)."""
    kind = "near" if negatives == "near" else rng.choice(["near", "near", "far", "empty", "bare"])
    if kind == "near":
        return response.format(answer=right + rng.choice([-1, 1]) * rng.randint(1, 10))
    if kind == "far":
        return response.format(answer=rng.choice([n for n in range(200) if n != right]))
    if kind == "empty":
        return response.format(answer="")
    return str(right)


def rows(tasks, response: str, count: int, seed: int, negatives: str) -> list[dict]:
    """`count` preference rows (cycling through `tasks`): the right answer over a wrong one."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        task = tasks[index % len(tasks)]
        right = int(task.reference)
        out.append(
            {
                # What the reward-server hands the model: the task's question, not the
                # rendered prompt (`ScoreItem.prompt`).
                "prompt": task.question,
                "chosen": response.format(answer=right),
                "rejected": wrong_answer(right, response, rng, negatives),
            }
        )
    return out


def write(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="training pairs")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--serve-steps", type=int, default=0, help="RL steps on the served RM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--negatives",
        choices=["near", "mixed"],
        default="mixed",
        help="wrong training answers: near misses only, or mixed with far, empty and untagged",
    )
    parser.add_argument(
        "--out", type=Path, help="keep the model and runs here (else a temporary folder)"
    )
    parser.add_argument(
        "--serve-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a --set for the RL run on the served model (repeatable)",
    )
    args = parser.parse_args()

    from rollwire.services.app.launcher import prepare_model
    from rollwire.services.core.config import RunConfig
    from rollwire.services.core.datasets import load_tasks, training_tasks

    config = RunConfig()
    model = prepare_model(config)
    settings = config.orchestrator
    train_tasks = training_tasks(settings.dataset, settings.eval_dataset)
    held_tasks = load_tasks(settings.eval_dataset)
    response = config.warmup.response_template
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.out or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        train = write(
            work / "train.jsonl", rows(train_tasks, response, args.pairs, args.seed, args.negatives)
        )
        held = write(
            work / "held.jsonl",
            rows(held_tasks, response, len(held_tasks), args.seed + 1, "near"),
        )
        out = work / "rm"
        started = time.perf_counter()
        subprocess.run(
            [
                *ROLLWIRE,
                "reward-model",
                "--set",
                f"trainer.model_path={model}",
                "--set",
                f"run.output_dir={out}",
                "--set",
                f"reward_model.data={train}",
                "--set",
                f"reward_model.eval_data={held}",
                "--set",
                "reward_model.chat=false",
                "--set",
                f"reward_model.max_steps={args.steps}",
                "--set",
                "reward_model.epochs=100",
                "--set",
                "reward_model.batch_size=32",
                "--set",
                "reward_model.eval_every=50",
                "--set",
                f"reward_model.seed={args.seed}",
                "--set",
                "trainer.optimizer.learning_rate=3e-4",
                "--set",
                "trainer.batching.micro_batch_size=64",
            ],
            env=env,
            check=True,
        )
        seconds = time.perf_counter() - started
        curve = [
            row for row in metrics(out / "metrics" / "reward-model.jsonl") if "eval_accuracy" in row
        ]
        print(
            f"\nreward model: {args.pairs} training pairs, {len(held_tasks)} held-out pairs, "
            f"{args.steps} steps, seed {args.seed}, {seconds:.0f} s"
        )
        print(f"{'step':>6} {'held-out accuracy':>18} {'held-out loss':>14}")
        for row in curve:
            print(f"{row['step']:>6} {row['eval_accuracy']:>18.3f} {row['eval_loss']:>14.4f}")
        if not args.serve_steps:
            return 0
        run = work / "run"
        served = {"model_path": str(out / "final"), "chat": False, "output": "sigmoid"}
        subprocess.run(
            [
                *ROLLWIRE,
                "train",
                "--set",
                f"run.output_dir={run}",
                "--set",
                f"rl.max_steps={args.serve_steps}",
                "--set",
                "orchestrator.dataset.domain=reward_model",
                "--set",
                f"reward_server.reward_model={json.dumps(served)}",
                "--set",
                "orchestrator.eval_every=10",
                *[item for setting in args.serve_set for item in ("--set", setting)],
            ],
            env=env,
            check=True,
        )
        steps = metrics(run / "metrics" / "trainer.jsonl")
        evals = [row for row in metrics(run / "metrics" / "eval.jsonl")]
        extra = f" ({', '.join(args.serve_set)})" if args.serve_set else ""
        print(f"\nRL on the served reward model: {args.serve_steps} steps{extra}")
        print(f"{'step':>6} {'training reward (RM)':>21}")
        for row in steps[:: max(1, len(steps) // 6)] + steps[-1:]:
            print(f"{row['step']:>6} {row['reward_mean']:>21.3f}")
        print(f"{'version':>8} {'held-out accuracy (verifier)':>29}")
        for row in evals:
            print(f"{row['policy_version']:>8} {row['eval_reward']:>29.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
