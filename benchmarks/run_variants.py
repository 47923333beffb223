"""Short `rollwire train` runs of one config under several settings, their steps side by side.

    .venv-vllm/bin/python benchmarks/run_variants.py -c examples/smollm2.yaml --steps 20 \\
        --variant "base=" \\
        --variant "trainer on 2 threads=trainer.threads=2" \\
        --variant "publish overlapped=trainer.weights.overlap_publish=true"

Each `--variant NAME=KEY=VALUE,KEY=VALUE` is one run of `--steps` steps (the config's
own held-out evaluations off but for the first), one after the other, with nothing else
running. The table gives the mean step over the steps after `--skip` (start-up left out:
the first batches wait for the engine to load and generate), split by the trainer's
phases (`time_<phase>_seconds` in `metrics/trainer.jsonl`), the CPU the trainer used, and
each variant's step against the first variant's, measured in the same invocation.
One run each: step times on a 2-core machine move by a few percent between runs.
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

PHASES = ("wait", "proximal", "forward_backward", "optimizer", "publish", "checkpoint")


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, settings = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"a variant is NAME=KEY=VALUE[,KEY=VALUE...], not {text!r}"
        )
    return name, [item for item in settings.split(",") if item]


def run(config: str, overrides: list[str], steps: int, out: Path, timeout: float) -> list[dict]:
    """One `rollwire train`; the rows of its trainer.jsonl."""
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train", "-c", config]
    for item in (
        *overrides,
        f"rl.max_steps={steps}",
        f"run.output_dir={out}",
        f"orchestrator.eval_every={10 * steps}",
        "trainer.checkpointing.every=0",
    ):
        command += ["--set", item]
    with (out.parent / f"{out.name}.log").open("w") as log:
        done = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    if done.returncode != 0:
        tail = (out.parent / f"{out.name}.log").read_text().splitlines()[-30:]
        raise SystemExit(f"the run {' '.join(overrides) or '(base)'} failed:\n" + "\n".join(tail))
    return [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").open()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--variant", type=variant, action="append", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the mean")
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    args = parser.parse_args()
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} leaves nothing after --skip {args.skip}")
    out = args.out or Path(tempfile.mkdtemp(prefix="run-variants-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for index, (name, overrides) in enumerate(args.variant):
        started = time.perf_counter()
        rows = run(args.config, overrides, args.steps, out / f"v{index}", args.timeout)
        kept = rows[args.skip :]
        mean = {
            phase: sum(r.get(f"time_{phase}_seconds", 0.0) for r in kept) / len(kept)
            for phase in PHASES
        }
        mean["step"] = sum(r["wall_seconds"] for r in kept) / len(kept)
        mean["cores"] = sum(r["cpu_cores"] for r in kept) / len(kept)
        results.append((name, overrides, mean))
        print(
            f"{name}: {mean['step']:.2f} s a step ({time.perf_counter() - started:.0f} s the run)",
            flush=True,
        )
    base = results[0][2]["step"]
    print(
        f"\n{args.config}, steps {args.skip + 1}-{args.steps} of each run, mean seconds a "
        f"step, {os.cpu_count()} cores, one run each\n"
    )
    print("| variant | settings | step | vs first | " + " | ".join(PHASES) + " | trainer CPU |")
    print("|---|---|---:|---:|" + "---:|" * len(PHASES) + "---:|")
    for name, overrides, mean in results:
        cells = " | ".join(f"{mean[phase]:.2f}" for phase in PHASES)
        print(
            f"| {name} | {' '.join(overrides) or '(the config)'} | {mean['step']:.2f} "
            f"| {mean['step'] / base:.2f}x | {cells} | {mean['cores']:.2f} |"
        )
    print(f"\nruns in {out}")


if __name__ == "__main__":
    main()
