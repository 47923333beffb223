"""The same run in synchronous and asynchronous mode, side by side.

    .venv/bin/python benchmarks/sync_vs_async.py [--set key=value ...]

Runs `rollwire train` twice (rl.mode=sync, then rl.mode=async), each with a
fresh run directory, and prints wall time, trajectories/s, the fraction of
time the trainer sat idle waiting for data, and the held-out eval reward.

Then the overlap bound: in the sync run the trainer's wait per step is the time
generation (and scoring) took, and the rest of its step is training; async at
its best takes max(generation, training) a step. The last line is that bound over
async's measured step time (1.0: the overlap is perfect). Step 1 (warm-up) is
left out of the per-step means.
Extra `--set` options apply to both runs (e.g. --set rl.max_steps=50).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(mode: str, overrides: list[str], root: Path, config: str | None) -> dict[str, float]:
    run_dir = root / mode
    command = [
        sys.executable,
        "-m",
        "rollwire.services.app.cli",
        "train",
        "--set",
        f"run.output_dir={run_dir}",
        "--set",
        f"rl.mode={mode}",
    ]
    if config:
        command += ["-c", config]
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    steps = [
        json.loads(line)
        for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    eval_log = run_dir / "metrics" / "eval.jsonl"
    evals = (
        [json.loads(line) for line in eval_log.read_text().splitlines()]
        if eval_log.exists()
        else []
    )
    if not evals:  # orchestrator.eval_dataset=null
        evals = [{"eval_reward": float("nan")}]
    timed = [row for row in steps[1:] if "wall_seconds" in row] or steps
    step = sum(row.get("wall_seconds", 0.0) for row in timed) / len(timed)
    wait = sum(row.get("time_wait_seconds", 0.0) for row in timed) / len(timed)
    return {
        "step_seconds": step,
        "wait_seconds": wait,
        "train_seconds": step - wait,
        "wall_seconds": wall,
        "training_seconds": steps[-1]["elapsed_seconds"],
        "trajectories_per_second": steps[-1]["trajectories_per_second"],
        "trainer_idle_fraction": steps[-1]["trainer_idle_fraction"],
        "eval_start": evals[0]["eval_reward"],
        "eval_end": evals[-1]["eval_reward"],
        "staleness_mean": sum(s.get("staleness_mean", 0) for s in steps) / len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", help="run configuration for both runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-") as root:
        results = {
            mode: run(mode, args.overrides, Path(root), args.config) for mode in ("sync", "async")
        }
    sync, asynchronous = results["sync"], results["async"]
    print(f"{'':<26}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key, fmt in (
        ("wall_seconds", "{:.1f}"),
        ("training_seconds", "{:.1f}"),
        ("step_seconds", "{:.3f}"),
        ("wait_seconds", "{:.3f}"),
        ("train_seconds", "{:.3f}"),
        ("trajectories_per_second", "{:.1f}"),
        ("trainer_idle_fraction", "{:.2f}"),
        ("staleness_mean", "{:.2f}"),
        ("eval_start", "{:.3f}"),
        ("eval_end", "{:.3f}"),
    ):
        ratio = asynchronous[key] / sync[key] if sync[key] else float("nan")
        print(
            f"{key:<26}{fmt.format(sync[key]):>10}{fmt.format(asynchronous[key]):>10}{ratio:>11.2f}x"
        )
    bound = max(sync["wait_seconds"], sync["train_seconds"])
    print(
        f"overlap bound: max(sync generation {sync['wait_seconds']:.3f}s, sync training "
        f"{sync['train_seconds']:.3f}s) = {bound:.3f}s a step; async takes "
        f"{asynchronous['step_seconds']:.3f}s: {bound / asynchronous['step_seconds']:.2f} of the bound"
    )


if __name__ == "__main__":
    main()
