"""A flame graph of each service of a short training run, and where each spends its time.

    .venv/bin/python benchmarks/profile_run.py [-c CONFIG] [--set KEY=VALUE ...]
        [--steps 10] [--rate 50] [--out profile]

Runs `rollwire train` (the default task unless `-c` names another) for `--steps` steps
and attaches py-spy (`pip install 'rollwire[profile]'`; root, or ptrace allowed) to every
service once the first step is done (so start-up and warm-up are left out), finding them
by the `logs/<service>.pid` files the launcher writes; a service restarted later is
profiled too.
Each service gets `OUT/<service>.svg` (open it in a browser: a frame's width is its share
of the samples) and `OUT/<service>.txt` (py-spy's collapsed stacks). The table printed at
the end gives each service's samples and the functions where most of them were spent
(self time: the innermost frame). py-spy samples only threads that are running, so a
service's samples over the seconds profiled are the cores it kept busy.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install 'rollwire[profile]'")
    return found


def attach(binary: str, pid: int, out: Path, name: str, rate: int) -> list[subprocess.Popen]:
    """Two non-blocking recorders on `pid`: the SVG flame graph and the collapsed stacks."""
    recorders = []
    for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
        recorders.append(
            subprocess.Popen(
                [
                    *(binary, "record", "--pid", str(pid), "--rate", str(rate)),
                    *("--nonblocking", "--format", fmt, "--output", str(out / f"{name}.{suffix}")),
                ],
                stdout=subprocess.DEVNULL,
                stderr=(out / f"{name}.py-spy.log").open("a"),
            )
        )
    return recorders


def busiest(collapsed: Path, top: int) -> tuple[int, list[tuple[str, int]]]:
    """(samples, the `top` innermost frames by samples) of a raw profile; samples with
    no Python frame (native threads: gRPC's, torch's) count as "(native)"."""
    frames: collections.Counter[str] = collections.Counter()
    total = 0
    if not collapsed.exists():
        return 0, []
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        frames[stack.split(";")[-1].strip() or "(native)"] += int(count)
    return total, frames.most_common(top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", help="run config (default: the default task)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=10, help="rl.max_steps of the run")
    parser.add_argument("--rate", type=int, default=50, help="samples per second")
    parser.add_argument("--top", type=int, default=6, help="functions listed per service")
    parser.add_argument("--out", type=Path, default=Path("profile"), help="output folder")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the run may take")
    args = parser.parse_args()
    binary = py_spy()
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    run_dir = out / "run"
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train"]
    if args.config:
        command += ["-c", args.config]
    for item in [
        f"rl.max_steps={args.steps}",
        f"run.output_dir={run_dir}",
        *args.set,
    ]:
        command += ["--set", item]
    log = (out / "train.log").open("w")
    train = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    recorders: list[subprocess.Popen] = []
    seen: dict[str, int] = {}
    deadline = time.monotonic() + args.timeout
    first_step = run_dir / "metrics" / "trainer.jsonl"
    profiled_from: float | None = None
    try:
        while train.poll() is None:
            if time.monotonic() > deadline:
                train.terminate()
                train.wait(timeout=120)
                raise SystemExit(f"the run took over {args.timeout:.0f}s: see {out / 'train.log'}")
            if profiled_from is None:
                if not first_step.exists() or not first_step.stat().st_size:
                    time.sleep(0.2)
                    continue
                profiled_from = time.monotonic()
            for pid_file in sorted((run_dir / "logs").glob("*.pid")):
                name = pid_file.stem
                text = pid_file.read_text().strip()
                if not text.isdigit() or seen.get(name) == int(text):
                    continue
                if name in seen:  # restarted: a second profile beside the first
                    name = f"{name}-{text}"
                seen[pid_file.stem] = int(text)
                recorders += attach(binary, int(text), out, name, args.rate)
            time.sleep(0.2)
    finally:
        for recorder in recorders:  # each ends with its process; writes its file then
            try:
                recorder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                recorder.terminate()
                recorder.wait(timeout=30)
    log.close()
    seconds = time.monotonic() - (profiled_from or time.monotonic())
    if train.returncode != 0:
        print(f"the run failed (exit {train.returncode}): see {out / 'train.log'}")
    print(
        f"steps 2-{args.steps}: {seconds:.0f}s profiled at {args.rate} samples/s; "
        f"flame graphs in {out}"
    )
    print(f"{'service':<16}{'cores':>6}  busiest functions (share of its samples)")
    for name in sorted(seen):
        total, top = busiest(out / f"{name}.txt", args.top)
        cores = total / max(seconds * args.rate, 1e-9)
        listed = "; ".join(f"{frame} {samples / max(total, 1):.0%}" for frame, samples in top)
        print(f"{name:<16}{cores:>6.2f}  {listed}")
    return train.returncode


if __name__ == "__main__":
    sys.exit(main())
