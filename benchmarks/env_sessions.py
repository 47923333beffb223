"""Many sessions on one env-server: open them all, step them all, measure the server.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_sessions.py [--sessions 500 2000 4000]

Starts one `rollwire env-server` process (limit raised to the largest count),
then for each count opens that many `guess_the_number` sessions at once over
one Multiplex stream, plays three (never winning) steps in every session, closes them, and
prints a table: seconds to open them, steps/s with all of them live, and the
server's resident memory with them open (from /proc, Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def measure(address: str, count: int, pid: int) -> dict[str, float]:
    from rollwire.envs.client import RemoteEnvs
    from rollwire.services.core.config import ClientConfig

    envs = RemoteEnvs(address, ClientConfig(default_timeout_seconds=120))
    try:
        before = resident_mib(pid)
        started = time.perf_counter()
        opened = await asyncio.gather(
            *(envs.reset("guess_the_number", seed=i, kwargs={"high": 1000}) for i in range(count))
        )
        open_seconds = time.perf_counter() - started
        live = resident_mib(pid)
        sessions = [session for session, _, _ in opened]
        started = time.perf_counter()
        for guess in ("0", "-1", "-2"):  # below the range: never correct, never done
            await asyncio.gather(*(envs.step(s, guess) for s in sessions))
        step_seconds = time.perf_counter() - started
        await asyncio.gather(*(envs.close(s) for s in sessions))
        return {
            "open_seconds": open_seconds,
            "steps_per_second": 3 * count / step_seconds,
            "rss_mib": live,
            "kib_per_session": (live - before) * 1024 / count,
        }
    finally:
        await envs.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[500, 2000, 4000])
    args = parser.parse_args()
    largest = max(args.sessions)
    with tempfile.TemporaryDirectory() as folder:
        ready = Path(folder) / "env.addr"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollwire.services.app.cli",
                "env-server",
                "--port",
                "0",
                "--ready-file",
                str(ready),
                "--set",
                f"env_server.max_sessions={largest}",
                "--set",
                "telemetry.log_level=warning",
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not (ready.exists() and ready.read_text().strip()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the env-server did not start")
                time.sleep(0.05)
            address = ready.read_text().strip()
            rows = [(n, asyncio.run(measure(address, n, server.pid))) for n in args.sessions]
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    print("\n| sessions | open all (s) | steps/s, all live | server RSS (MiB) | KiB/session |")
    print("|---:|---:|---:|---:|---:|")
    for count, r in rows:
        print(
            f"| {count} | {r['open_seconds']:.2f} | {r['steps_per_second']:,.0f} "
            f"| {r['rss_mib']:.0f} | {r['kib_per_session']:.1f} |"
        )


if __name__ == "__main__":
    main()
