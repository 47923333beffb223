"""Agentic RL with heavy-tailed environment latency, synchronous against asynchronous.

    .venv/bin/python benchmarks/agentic_long_tail.py [--steps 30] [--median-ms 200]
        [--tail 1.0] [--turns 3] [--max-staleness 2] [--repeats 1] [--no-control]
        [--set key=value ...]

Runs `rollwire train` (every service its own process) on the `long_tail`
environment of `benchmarks/long_tail_env.py`, whose steps sleep a lognormal
latency, once with rl.mode=sync and once with rl.mode=async, everything else
equal, and prints a markdown table of the time to a fixed number of trained
steps. Time is the trainer's `elapsed_seconds` at its last step: from the
moment its loop starts waiting for the first batch to the end of the last
step (the first batch's episodes are inside it, process start-up and the
final checkpoint are not). The control rows run the same with `tail` 0: every
step takes exactly the median, so whatever async gains there is overlap of
generation, environment and training, not the hidden tail. With --repeats N
each row is the run of median time among N. Each run is configured with
SPARE_STEPS more steps than measured and stopped once --steps are trained.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rollwire.services.core.files import read_jsonl

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_SECONDS = 3600

ANCHORS = (
    "Published anchors (their hardware, models and environments, not this setup): "
    "ROLL Flash reports 2.72x for asynchronous over synchronous training on agentic tasks; "
    "AReaL reports up to 2.77x overall."
)


def base_overrides(args: argparse.Namespace, tail: float) -> list[str]:
    kwargs = f"{{median_ms: {args.median_ms}, tail: {tail}, turns: {args.turns}}}"
    return [
        "env_server.plugins=[long_tail_env]",
        f"orchestrator.dataset={{type: env, env_id: long_tail, env_kwargs: {kwargs}}}",
        "orchestrator.eval_dataset=null",
        "orchestrator.max_new_tokens=8",
        f"orchestrator.agent.max_turns={args.turns}",
        "orchestrator.agent.max_episode_tokens=200",
        "run.tiny_model={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2}",
        "warmup.steps=0",
        "rl.group_size=4",
        "rl.groups_per_step=8",
        f"rl.max_staleness={args.max_staleness}",
        *args.overrides,
    ]


def run(
    mode: str, overrides: list[str], run_dir: Path, cache: Path, steps: int
) -> dict[str, float]:
    """One `rollwire train` of `steps` steps; its trainer metrics at the last one."""
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train"]
    items = (f"run.output_dir={run_dir}", f"rl.mode={mode}", *overrides)
    for item in (*items, f"rl.max_steps={steps}"):
        command += ["--set", item]
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "ROLLWIRE_CACHE_DIR": str(cache),
        "OMP_NUM_THREADS": "1",
    }
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics" / "trainer.jsonl"
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            process.wait(timeout=RUN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # `rollwire train` stops every service
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    rows = trained(metrics)[:steps]
    if process.returncode != 0 or len(rows) < steps:
        raise SystemExit(f"{mode} run failed or stalled:\n{log.read_text()[-3000:]}")
    last = rows[-1]
    return {
        "steps": last["step"],
        "seconds": last["elapsed_seconds"],
        "steps_per_minute": 60 * last["step"] / last["elapsed_seconds"],
        "trajectories_per_second": last["trajectories_per_second"],
        "trainer_idle_fraction": last["trainer_idle_fraction"],
        "staleness_mean": sum(s.get("staleness_mean", 0) for s in rows) / len(rows),
        "reward_mean": sum(s["reward_mean"] for s in rows) / len(rows),
    }


def trained(metrics: Path) -> list[dict]:
    """Complete lines of trainer.jsonl written so far."""
    return read_jsonl(metrics)


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    middle = statistics.median_low(r["seconds"] for r in runs)
    return next(r for r in runs if r["seconds"] == middle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--median-ms", type=float, default=200.0, help="median env step latency")
    parser.add_argument(
        "--tail", type=float, default=1.0, help="lognormal sigma of the env step latency"
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per episode")
    parser.add_argument("--max-staleness", type=int, default=2, help="rl.max_staleness in async")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row; the median is kept")
    parser.add_argument(
        "--no-control", dest="control", action="store_false", help="skip the tail=0 rows"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    rows: list[tuple[str, float, str]] = [("tail", args.tail, "sync"), ("tail", args.tail, "async")]
    if args.control:
        rows += [("no tail", 0.0, "sync"), ("no tail", 0.0, "async")]
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rollwire-long-tail-") as root:
        cache = Path(os.environ.get("ROLLWIRE_CACHE_DIR") or Path(root) / "cache")
        for label, tail, mode in rows:
            runs = []
            for repeat in range(args.repeats):
                run_dir = Path(root) / f"{label.replace(' ', '-')}-{mode}-{repeat}"
                runs.append(run(mode, base_overrides(args, tail), run_dir, cache, args.steps))
                print(
                    f"{label} {mode} #{repeat}: {runs[-1]['seconds']:.1f}s to step {args.steps}",
                    file=sys.stderr,
                )
            results[label, mode] = median_run(runs)
    print(
        f"\nlong_tail env: {args.turns} turns, step latency lognormal median {args.median_ms:g} ms, "
        f"sigma {args.tail:g} (no tail: sigma 0); group_size 4, 8 groups/step, "
        f"async max_staleness {args.max_staleness}; "
        f"{'median' if args.repeats > 1 else 'one'} of {args.repeats} run(s) each.\n"
        "seconds: trainer loop start (waiting for the first batch) to the end of the last step.\n"
    )
    print(
        "| env | mode | steps | seconds | steps/min | trainer idle | mean staleness "
        "| reward | speed-up |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, _, mode in rows:
        r = results[label, mode]
        sync = results[label, "sync"]
        speedup = f"{sync['seconds'] / r['seconds']:.2f}x" if mode == "async" else "1.00x"
        print(
            f"| {label} | {mode} | {r['steps']:.0f} | {r['seconds']:.1f} "
            f"| {r['steps_per_minute']:.1f} | {r['trainer_idle_fraction']:.2f} "
            f"| {r['staleness_mean']:.2f} | {r['reward_mean']:.3f} | {speedup} |"
        )
    print(f"\n{ANCHORS}")


if __name__ == "__main__":
    main()
