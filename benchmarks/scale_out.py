"""A rollout-server added to a running run: how long until it takes work, and the run's
rate of finished groups before and after.

    .venv/bin/python benchmarks/scale_out.py [--window 30] [--set KEY=VALUE ...]

Starts `rollwire train` (the built-in default run, long enough not to end, with
`endpoints.refresh_seconds: 1` and the extra --set overrides), waits for step 10,
counts the groups the orchestrator finishes in --window seconds, then runs
`rollwire scale RUN rollout-server=+1` and times: the command until its server is
ready (a process started, its model loaded), and the orchestrator's admission (the
server serving the current weights, sent by the trainer). Then counts again over
--window seconds and stops the run by SIGTERM (its launcher stops every process).
On two cores a second engine adds no arithmetic: the rise it shows is the overlap it
adds, if any.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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


def groups_at(run: Path) -> tuple[float, int]:
    """(time, groups completed) of the orchestrator's newest report."""
    last = rows(run / "metrics" / "orchestrator.jsonl")[-1]
    return last["time"], last["groups_completed"]


def rate(run: Path, window: float) -> float:
    """Groups finished per second over the next `window` seconds."""
    start_time, start_groups = groups_at(run)
    time.sleep(window)
    end_time, end_groups = groups_at(run)
    return (end_groups - start_groups) / max(end_time - start_time, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds per rate (30)")
    parser.add_argument("--set", action="append", default=[], help="more overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        run = Path(temp) / "run"
        command = [*ROLLWIRE, "train"]
        for item in [
            f"run.output_dir={run}",
            "rl.max_steps=100000",
            "endpoints.refresh_seconds=1",
            "orchestrator.eval_every=100000",
            *args.set,
        ]:
            command += ["--set", item]
        launcher = subprocess.Popen(
            command,
            stdout=open(Path(temp) / "launcher.log", "w"),  # noqa: SIM115 - closed with the run
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            deadline = time.monotonic() + 900
            while not rows(run / "metrics" / "trainer.jsonl") or (
                rows(run / "metrics" / "trainer.jsonl")[-1]["step"] < 10
            ):
                if launcher.poll() is not None or time.monotonic() > deadline:
                    tail = (Path(temp) / "launcher.log").read_text()[-2000:]
                    raise SystemExit(f"the run did not reach step 10:\n{tail}")
                time.sleep(0.5)
            before = rate(run, args.window)
            started = time.perf_counter()
            scaled = subprocess.run(
                [*ROLLWIRE, "scale", str(run), "rollout-server=+1"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            ready = time.perf_counter() - started
            if scaled.returncode != 0:
                raise SystemExit(scaled.stdout + scaled.stderr)
            admitted = None
            while admitted is None and time.perf_counter() - started < 300:
                log = (run / "logs" / "orchestrator.log").read_text()
                found = re.search(r"takes work now \(([\d.]+) s after it joined\)", log)
                admitted = float(found.group(1)) if found else None
                time.sleep(0.5)
            after = rate(run, args.window)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGTERM)
                launcher.wait(timeout=120)
    print(f"{'':<44} {'seconds':>8}")
    print(f"{'rollwire scale: started to ready':<44} {ready:>8.1f}")
    shown = "never" if admitted is None else f"{admitted:.1f}"
    print(f"{'ready to taking work (weights, admission)':<44} {shown:>8}")
    print(f"\n{'rollout-servers':<16} {'groups/s':>9}")
    print(f"{1:<16} {before:>9.2f}\n{2:<16} {after:>9.2f}  ({after / before:.2f}x)")


if __name__ == "__main__":
    main()
