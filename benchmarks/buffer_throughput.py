"""Trajectories/s through the replay buffer, durable or not, against raw pyzmq PUSH/PULL.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/buffer_throughput.py [--dir /path/on/the/real/disk]

Payloads are real wire frames: a 128-token Trajectory through
rollwire.services.core.wire.encode (about 2.7 KB), the same as benchmarks/durable_log.py.

Raw rows: one PUSH process sends to one PULL process over loopback TCP, either
packing the frame's msgpack map inside the send loop or sending pre-packed
bytes; the rate is counted at the receiver from its first message to its last.

Buffer rows: `rollwire buffer` runs in its own process (the CLI, as deployed),
fresh for every row, with its log in a temp dir under --dir. A producer
process runs N concurrent BufferProducer instances on one asyncio loop (one
DEALER each, one request in flight each, awaiting every ack); each puts whole
groups of 8, one trajectory a message, or (the `put_group` rows, as the
orchestrator does) a whole group a message. A trainer process takes batches of --batch-groups groups with
BufferTrainerClient and acknowledges each at once, so the buffer never fills.
The rate runs from the producers' first put to the trainer holding the last
trajectory; it includes encoding in the producers and decoding in the buffer and
trainer. Latency is put -> batch: each trajectory carries time.monotonic() at put
in its timings (CLOCK_MONOTONIC, the same clock in every process), read when
its batch has been decoded by the trainer; it includes waiting for the batch to fill.

Ratios are against both raw rows, measured in the same run on the same machine.
Buffer rows use three processes; on a 2-core machine they share the cores.
--profile adds a cProfile run of the buffer process (durable, log_sync=batch,
most producers) and prints where its time goes; that run is not in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from durable_log import realistic_trajectory  # benchmarks/durable_log.py, beside this file

from rollwire.services.core.wire import SCHEMA_VERSION, Trajectory, _trajectory_body, encode

GROUP_SIZE = 8
TIMEOUT = 120.0


def template(tokens: int = 128) -> Trajectory:
    """The durable-log benchmark's trajectory, stamped with the time it is put."""
    return dataclasses.replace(
        realistic_trajectory(tokens),
        timings={"generate": 1.8, "reward": 0.01, "put": time.monotonic()},
    )


# ---------------------------------------------------------------- raw PUSH/PULL


def raw_puller(port_queue: Any, results: Any, count: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    port_queue.put(port)
    received = 0
    socket.recv()  # the first message starts the clock
    started = time.monotonic()
    for _ in range(count):
        received += len(socket.recv())
    results.put((time.monotonic() - started, received))
    socket.close(0)
    context.term()


def raw_pusher(port: int, count: int, pack_in_loop: bool) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, -1)
    socket.connect(f"tcp://127.0.0.1:{port}")
    trajectory = template()
    message = {"schema": SCHEMA_VERSION, "kind": "trajectory", "body": _trajectory_body(trajectory)}
    packed = encode(trajectory)
    for _ in range(count + 1):
        if pack_in_loop:
            socket.send(msgpack.packb(message, use_bin_type=True))
        else:
            socket.send(packed)
    socket.close()
    context.term()


def raw_row(spawn: Any, count: int, pack_in_loop: bool) -> dict[str, Any]:
    port_queue, results = spawn.Queue(), spawn.Queue()
    puller = spawn.Process(target=raw_puller, args=(port_queue, results, count))
    puller.start()
    port = port_queue.get(timeout=TIMEOUT)
    pusher = spawn.Process(target=raw_pusher, args=(port, count, pack_in_loop))
    pusher.start()
    took, received = results.get(timeout=TIMEOUT)
    for process in (pusher, puller):
        process.join(TIMEOUT)
    return {"records": count, "seconds": took, "bytes": received, "latency": None}


# ---------------------------------------------------------------- buffer


def producers_main(
    endpoint: str, producers: int, groups_each: int, results: Any, whole_groups: bool = False
) -> None:
    from rollwire.services.buffer.client import BufferProducer

    base = template()

    async def produce(producer: BufferProducer, index: int) -> int:
        refused = 0
        for group in range(groups_each):
            group_id = f"run-7/p{index}/g{group:07d}"
            group_trajectories = [
                dataclasses.replace(
                    base,
                    trajectory_id=f"{group_id}/s{sample}",
                    group_id=group_id,
                    sample_index=sample,
                    # One prompt ordinal per group, as the orchestrator numbers them.
                    prompt_ordinal=index * groups_each + group,
                    timings={"generate": 1.8, "reward": 0.01, "put": time.monotonic()},
                )
                for sample in range(GROUP_SIZE)
            ]
            if whole_groups:  # the orchestrator's way: one message, one round trip a group
                acks = await producer.put_group(group_trajectories)
            else:
                acks = [await producer.put(t) for t in group_trajectories]
            refused += sum(not ack.accepted for ack in acks)
        return refused

    async def run() -> None:
        clients = [BufferProducer(endpoint, timeout=TIMEOUT, attempts=1) for _ in range(producers)]
        await asyncio.gather(*(client.status() for client in clients))  # connected, warm
        started = time.monotonic()
        refused = await asyncio.gather(*(produce(c, i) for i, c in enumerate(clients)))
        results.put(("producers", started, time.monotonic(), sum(refused)))
        for client in clients:
            client.close()

    asyncio.run(run())


def trainer_main(endpoint: str, total: int, batch_groups: int, results: Any) -> None:
    from rollwire.services.buffer.client import BufferTrainerClient

    client = BufferTrainerClient(endpoint, timeout=TIMEOUT)
    client.status()
    latencies = np.empty(total)
    received = 0
    while received < total:
        groups = min(batch_groups, (total - received) // GROUP_SIZE)
        batch = client.get_batch(0, groups, wait_seconds=1.0)
        if batch is None:
            continue
        now = time.monotonic()
        for trajectory in batch.trajectories:
            latencies[received] = now - trajectory.timings["put"]
            received += 1
        client.ack(batch.batch_id, 0)
    results.put(("trainer", time.monotonic(), latencies))
    client.close()


def start_buffer(
    scratch: Path, durable: bool, sync: str, profile: Path | None = None
) -> tuple[subprocess.Popen, dict[str, str]]:
    ready = scratch / "ready.json"
    python = [sys.executable]
    if profile is not None:
        python += ["-m", "cProfile", "-o", str(profile)]
    command = [
        *python,
        *("-m", "rollwire.services.app.cli", "buffer", "--ready-file", str(ready)),
        *("--set", f"buffer.durable={str(durable).lower()}"),
        *("--set", f"buffer.log_sync={sync}"),
        *("--set", f"rl.group_size={GROUP_SIZE}"),
        *("--set", f"run.output_dir={scratch}"),
        *("--set", "telemetry.log_level=warning"),
    ]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the buffer did not start: {' '.join(command)}")
        time.sleep(0.05)
    return process, json.loads(ready.read_text())


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def buffer_row(
    spawn: Any,
    root: Path,
    durable: bool,
    sync: str,
    producers: int,
    records: int,
    batch_groups: int,
    profile: Path | None = None,
    whole_groups: bool = False,
) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(dir=root))
    buffer, endpoints = start_buffer(scratch, durable, sync, profile)
    try:
        groups_each = max(1, records // (GROUP_SIZE * producers))
        total = groups_each * GROUP_SIZE * producers
        results = spawn.Queue()
        trainer = spawn.Process(
            target=trainer_main, args=(endpoints["trainer"], total, batch_groups, results)
        )
        producer = spawn.Process(
            target=producers_main,
            args=(endpoints["producer"], producers, groups_each, results, whole_groups),
        )
        trainer.start()
        producer.start()
        got = {}
        for _ in range(2):
            item = results.get(timeout=TIMEOUT * 5)
            got[item[0]] = item[1:]
        for process in (producer, trainer):
            process.join(TIMEOUT)
            if process.is_alive():
                process.terminate()
    finally:
        stop(buffer)
    started, _, refused = got["producers"]
    ended, latencies = got["trainer"]
    if refused:
        raise RuntimeError(f"the buffer refused {refused} puts")
    size = len(encode(template()))
    return {
        "records": total,
        "seconds": ended - started,
        "bytes": total * size,
        "latency": latencies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw-records", type=int, default=200_000, help="records per raw row")
    parser.add_argument("--records", type=int, default=16_000, help="records per buffer row")
    parser.add_argument(
        "--always-records", type=int, default=4_000, help="records for log_sync=always"
    )
    parser.add_argument("--producers", default="1,8", help="producer counts, comma-separated")
    parser.add_argument("--batch-groups", type=int, default=8, help="groups of 8 per trainer batch")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the buffer's log goes (default: a temp dir)"
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile the buffer process")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn = multiprocessing.get_context("spawn")
    counts = [int(n) for n in args.producers.split(",")]
    rows = [
        ("raw PUSH/PULL, msgpack.packb in the loop", raw_row(spawn, args.raw_records, True)),
        ("raw PUSH/PULL, pre-packed bytes", raw_row(spawn, args.raw_records, False)),
    ]
    cases = [
        ("buffer, durable=false", False, "batch", args.records, False),
        ("buffer, durable, log_sync=batch", True, "batch", args.records, False),
        ("buffer, durable, log_sync=always", True, "always", args.always_records, False),
        ("buffer, durable=false, put_group", False, "batch", args.records, True),
        ("buffer, durable, log_sync=batch, put_group", True, "batch", args.records, True),
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        root = Path(scratch)
        for name, durable, sync, records, whole_groups in cases:
            for producers in counts:
                row = buffer_row(
                    spawn,
                    root,
                    durable,
                    sync,
                    producers,
                    records,
                    args.batch_groups,
                    whole_groups=whole_groups,
                )
                rows.append((f"{name}, {producers} producer(s)", row))
        if args.profile:
            profile = root / "buffer.prof"
            buffer_row(
                spawn, root, True, "batch", max(counts), args.records, args.batch_groups, profile
            )
            profiled = pstats.Stats(str(profile))
    packing, packed = rows[0][1], rows[1][1]
    packing_rate = packing["records"] / packing["seconds"]
    packed_rate = packed["records"] / packed["seconds"]
    size = len(encode(template()))
    print(f"payload: {size} bytes (wire-encoded 128-token Trajectory), cores: {os.cpu_count()}")
    print(f"trainer batches: {args.batch_groups} groups of {GROUP_SIZE}\n")
    print(
        "| case | records | records/s | MB/s | vs raw packing | vs raw pre-packed "
        "| put-to-batch p50 ms | p99 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows:
        rate = row["records"] / row["seconds"]
        megabytes = row["bytes"] / row["seconds"] / 1e6
        p50 = p99 = "n/a"
        if row["latency"] is not None:
            p50, p99 = (f"{ms:,.1f}" for ms in np.percentile(row["latency"], [50, 99]) * 1e3)
        print(
            f"| {name} | {row['records']} | {rate:,.0f} | {megabytes:,.1f} "
            f"| {rate / packing_rate:.2f}x | {rate / packed_rate:.2f}x | {p50} | {p99} |"
        )
    if args.profile:
        print("\nbuffer process, durable log_sync=batch, under cProfile (tottime):\n")
        profiled.sort_stats("tottime").print_stats(20)
        profiled.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
