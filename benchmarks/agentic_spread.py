"""Run-to-run spread of the agentic example (`examples/agentic.yaml`), as a new user runs it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agentic_spread.py [--seeds 0 1 2] [--out DIR]

One `rollwire train -c examples/agentic.yaml` per seed (`orchestrator.sampling_seed`),
each in a fresh run folder; the first also from an empty model cache, so its warm-up
(800 supervised steps on demonstrations) is part of its wall time, as on a new machine;
the others reuse that warm model. For each run: wall seconds, warm-up seconds (launch
to the trainer's start: the warm-up, when it runs, and the services starting), training seconds (the
trainer's), trajectories/s, the trainer's idle share, response tokens per sequence over
the first and last 10 steps, and the held-out success by version. Then mean and spread.
Run it on a quiet machine: every figure is a wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agentic.yaml"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(root: Path, seed: int, cache: Path) -> dict:
    run_dir = root / f"seed{seed}"
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train", "-c", str(EXAMPLE)]
    command += ["--set", f"run.output_dir={run_dir}", "--set", f"orchestrator.sampling_seed={seed}"]
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    launched = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env)
    wall = time.time() - launched
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    evals = [
        (int(e["policy_version"]), e["eval_reward"])
        for e in jsonl(run_dir / "metrics" / "eval.jsonl")
    ]
    first = steps[0]
    return {
        "seed": seed,
        "wall": wall,
        "warmup": first["time"] - first["elapsed_seconds"] - launched,
        "training": steps[-1]["elapsed_seconds"],
        "traj_per_s": steps[-1]["trajectories_per_second"],
        "idle": steps[-1]["trainer_idle_fraction"],
        "tokens_first": statistics.fmean(s["response_tokens_mean"] for s in steps[:10]),
        "tokens_last": statistics.fmean(s["response_tokens_mean"] for s in steps[-10:]),
        "evals": evals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp dir)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="agentic-spread-"))
    cache = root / "cache"  # empty: the first run warms the model up, as a new user's does
    rows = []
    for seed in args.seeds:
        rows.append(one_run(root, seed, cache))
        row = rows[-1]
        print(f"seed {seed}: {row['training']:.0f} s training, {row['evals']}", flush=True)
    print(f"\nexamples/agentic.yaml, {len(rows)} runs (runs in {root}), cores: {os.cpu_count()}\n")
    print(
        "| seed | wall s | warm-up s | training s | trajectories/s | trainer idle "
        "| response tokens, first 10 steps | last 10 | held-out by version |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        curve = ", ".join(f"{v}: {r:.2f}" for v, r in row["evals"])
        print(
            f"| {row['seed']} | {row['wall']:.0f} | {row['warmup']:.0f} | {row['training']:.0f} "
            f"| {row['traj_per_s']:.1f} | {row['idle']:.2f} | {row['tokens_first']:.1f} "
            f"| {row['tokens_last']:.1f} | {curve} |"
        )
    if len(rows) > 1:
        for key in ("training", "traj_per_s", "idle"):
            values = [row[key] for row in rows]
            print(f"{key}: {statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}")
        finals = [row["evals"][-1][1] for row in rows]
        print(f"held-out final: {statistics.fmean(finals):.3f} ± {statistics.stdev(finals):.3f}")


if __name__ == "__main__":
    main()
