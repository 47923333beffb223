"""The default run as local processes and on a Ray cluster: held-out reward and time.

    .venv/bin/python benchmarks/ray_launcher.py --address HOST:PORT [--set KEY=VALUE ...]

Runs `rollwire train` (the built-in default run, with the --set overrides) twice, one
after the other: as local processes, then with `run.ray.address` set, and prints one
table of wall seconds (the warm-up is built before either is timed), seconds per
trainer step, the held-out reward at the start and at the end, and where Ray placed
each service. A cluster of two nodes on one machine, to try it (stop both by the pid
`ray start --block` runs as):

    ray start --head --block --port=0 --num-cpus=8 --resources='{"node_a": 1000}' \\
        --include-dashboard=false --disable-usage-stats &
    ray start --block --address=ADDRESS_IT_PRINTS --num-cpus=8 \\
        --resources='{"node_b": 1000}' --disable-usage-stats &

On one machine both runs share its cores: the comparison shows what placing the
services through Ray costs, not what more machines add.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLLWIRE = [sys.executable, "-m", "rollwire.services.app.cli"]


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(run_dir: Path, sets: list[str], log: Path) -> float:
    argv = [*ROLLWIRE, "train", "--set", f"run.output_dir={run_dir}"]
    for item in sets:
        argv += ["--set", item]
    began = time.perf_counter()
    with log.open("w") as output:
        code = subprocess.run(argv, stdout=output, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise SystemExit(f"rollwire train exited with {code}: {log}")
    return time.perf_counter() - began


def placed(run_dir: Path) -> str:
    where = {}
    for path in sorted((run_dir / "logs").glob("*.node")):
        labels = json.loads(path.read_text())["labels"]
        where.setdefault(",".join(labels) or "?", []).append(path.name.removesuffix(".node"))
    return "; ".join(f"{node}: {' '.join(names)}" for node, names in where.items()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the Ray cluster's GCS host:port")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="rollwire-ray-bench-"))
    # The warm-up, built once before anything is timed (the runs find it in the cache).
    subprocess.run(
        [
            *ROLLWIRE,
            "prepare",
            "--out",
            str(work / "model"),
            *(arg for item in args.sets for arg in ("--set", item)),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    results = []
    for name, extra in (
        ("local processes", []),
        ("Ray, 2 nodes", [f"run.ray={{address: '{args.address}'}}"]),
    ):
        run_dir = work / name.split(",")[0].replace(" ", "-")
        seconds = train(run_dir, [*args.sets, *extra], work / f"{run_dir.name}.log")
        steps = rows(run_dir / "metrics" / "trainer.jsonl")
        evals = rows(run_dir / "metrics" / "eval.jsonl")
        span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")
        results.append(
            (name, seconds, span / max(1, len(steps) - 1), evals[0], evals[-1], placed(run_dir))
        )
        print(f"{name}: {seconds:.0f} s", flush=True)
    base = results[0][1]
    print("\n| launcher | wall s | x local | s per step | held-out start -> end | placed |")
    print("|---|---|---|---|---|---|")
    for name, seconds, per_step, first, last, where in results:
        print(
            f"| {name} | {seconds:.0f} | {seconds / base:.2f} | {per_step:.2f} | "
            f"{first['eval_reward']:.3f} -> {last['eval_reward']:.3f} (v{last['policy_version']}) | {where} |"
        )
    print(f"\nrun folders: {work}")


if __name__ == "__main__":
    main()
