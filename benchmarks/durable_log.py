"""Append and replay speed of the durable log, against a plain file.write loop of the same bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/durable_log.py [--dir /path/on/the/real/disk]

Payloads are real wire frames: a 128-token Trajectory through
rollwire.services.core.wire.encode (about 2.7 KB). Each durable-log row is compared
with a plain loop that writes the same payloads to one file through a buffered
`file.write` and fsyncs as often as that sync mode does (never / every 64
records / every record), measured in the same run on the same disk; the replay
row is compared with reading the plain file back in one read. The fsync
rows measure the disk more than the code: run them where the buffer's log will live.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollwire.services.buffer.durable_log import DurableLog
from rollwire.services.core.wire import Trajectory, encode

BATCH = 64


def realistic_trajectory(tokens: int = 128) -> Trajectory:
    """A ~2.7 KB trajectory as the buffer sees them (also used by buffer_throughput.py)."""
    rng = np.random.default_rng(0)
    mask = (np.arange(tokens) >= tokens // 3).astype(np.uint8)  # prompt, then generated tokens
    return Trajectory(
        trajectory_id="run-7/step-42/prompt-1031/sample-3",
        group_id="run-7/prompt-1031",
        task_id="gsm8k/1031",
        sample_index=3,
        prompt_ordinal=1031,
        source="gsm8k",
        domain="math",
        token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -rng.random(tokens), 0).astype(np.float32),
        policy_versions=np.where(mask == 1, 41, -1).astype(np.int64),
        reward=1.0,
        reward_components={"correct": 1.0, "format": 0.0},
        timings={"generate": 1.8, "reward": 0.01},
    )


def realistic_payload(tokens: int = 128) -> bytes:
    return encode(realistic_trajectory(tokens))


def seconds(function: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def plain_writes(path: Path, payloads: list[bytes], fsync_every: int | None) -> None:
    with open(path, "wb") as file:
        for index, payload in enumerate(payloads, 1):
            file.write(payload)
            if fsync_every and index % fsync_every == 0:
                file.flush()
                os.fsync(file.fileno())
        file.flush()
        if fsync_every:
            os.fsync(file.fileno())


def log_appends(directory: Path, payloads: list[bytes], sync: str) -> None:
    with DurableLog(directory, sync=sync) as log:  # type: ignore[arg-type]
        if sync == "batch":
            for start in range(0, len(payloads), BATCH):
                log.append_many(payloads[start : start + BATCH])
        else:
            for payload in payloads:
                log.append(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000, help="records for never and batch")
    parser.add_argument("--always-records", type=int, default=1_000, help="records for always")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    payload = realistic_payload()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        root = Path(scratch)
        cases = [
            ("never", "append", args.records, None),
            ("batch", f"append_many({BATCH})", args.records, BATCH),
            ("always", "append", args.always_records, 1),
        ]
        for sync, call, count, fsync_every in cases:
            payloads = [payload] * count
            plain = seconds(plain_writes, root / f"plain-{sync}", payloads, fsync_every)
            durable = seconds(log_appends, root / f"log-{sync}", payloads, sync)
            rows.append((f"append, sync={sync}, {call}", count, durable, plain))
        directory = root / "log-never"
        with DurableLog(directory, sync="never") as log:
            replayed = 0
            started = time.perf_counter()
            for _ in log.replay():
                replayed += 1
            took = time.perf_counter() - started
        plain_read = seconds((root / "plain-never").read_bytes)
        rows.append(("replay (CRC-checked)", replayed, took, plain_read))
    print(f"payload: {len(payload)} bytes (wire-encoded 128-token Trajectory)\n")
    print("| case | records | records/s | MB/s | plain loop records/s | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, count, took, plain in rows:
        rate = count / took
        print(
            f"| {name} | {count} | {rate:,.0f} | {rate * len(payload) / 1e6:,.1f} "
            f"| {count / plain:,.0f} | {plain / took:.2f}x |"
        )


if __name__ == "__main__":
    main()
