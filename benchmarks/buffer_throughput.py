"""Trajectories/s through the replay buffer, durable or not, against raw pyzmq PUSH/PULL.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/buffer_throughput.py [--dir /path/on/the/real/disk]
        [--tokens 4096 --records 2000 --raw-records 20000]

Payloads are real wire frames: a `--tokens`-token Trajectory (128 by default) through
rollwire.services.core.wire.encode (about 2.7 KB at 128 tokens, 70 KB at 4,096: 17 bytes a token past
that), the same as benchmarks/durable_log.py.

Raw rows: one PUSH process sends to one PULL process over loopback TCP, either
packing the frame's msgpack map inside the send loop or sending pre-packed
bytes; the rate is counted at the receiver from its first message to its last.

Buffer rows: `rollwire buffer` runs in its own process (the CLI, as deployed),
fresh for every row, with its log in a temp dir under --dir. A producer process
runs P BufferProducer clients on one asyncio loop, each with K coroutines putting
at once (the row's "P x K in flight"; every put awaits its ack). Each puts groups
of 8, one trajectory a message (`put` rows) or, as the orchestrator does, a whole
group a message (`put_group` rows). A trainer process takes batches of
--batch-groups groups with BufferTrainerClient and acknowledges each at once, so
the buffer never fills: decoding every frame in full (get_batch, what the trainer
does), or, in the "frames" row, taking the frames as they come (get_frames: the
data plane alone). The rate runs from the producers' first put to the trainer
holding the last trajectory; it includes encoding in the producers, the buffer's
header read (wire.peek) and log, and the trainer's decoding. Latency is put ->
batch: each trajectory carries time.monotonic() at put in its timings
(CLOCK_MONOTONIC, the same clock in every process), read when its batch has
reached the trainer (in the frames row, from each batch's first trajectory); it
includes waiting for the batch to fill.

Ratios are against both raw rows, measured in the same run on the same machine.
Buffer rows use three processes; on a 2-core machine they share the cores.
--profile adds a cProfile run of the buffer process (durable, log_sync=batch,
put_group, 8 in flight) and prints where its time goes; that run is not in the table.
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
import psutil
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


def raw_pusher(port: int, count: int, pack_in_loop: bool, tokens: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, -1)
    socket.connect(f"tcp://127.0.0.1:{port}")
    trajectory = template(tokens)
    message = {"schema": SCHEMA_VERSION, "kind": "trajectory", "body": _trajectory_body(trajectory)}
    packed = encode(trajectory)
    for _ in range(count + 1):
        if pack_in_loop:
            socket.send(msgpack.packb(message, use_bin_type=True))
        else:
            socket.send(packed)
    socket.close()
    context.term()


def raw_row(spawn: Any, count: int, pack_in_loop: bool, tokens: int) -> dict[str, Any]:
    port_queue, results = spawn.Queue(), spawn.Queue()
    puller = spawn.Process(target=raw_puller, args=(port_queue, results, count))
    puller.start()
    port = port_queue.get(timeout=TIMEOUT)
    pusher = spawn.Process(target=raw_pusher, args=(port, count, pack_in_loop, tokens))
    pusher.start()
    took, received = results.get(timeout=TIMEOUT)
    for process in (pusher, puller):
        process.join(TIMEOUT)
    return {"records": count, "seconds": took, "bytes": received, "latency": None, "cpu": None}


# ---------------------------------------------------------------- buffer


def producers_main(
    endpoint: str,
    producers: int,
    in_flight: int,
    groups_each: int,
    results: Any,
    whole_groups: bool = False,
    tokens: int = 128,
) -> None:
    """`producers` BufferProducers, each with `in_flight` coroutines putting
    `groups_each` groups apiece (so that many requests in flight per producer)."""
    from rollwire.services.buffer.client import BufferProducer

    base = template(tokens)

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
        started, cpu = time.monotonic(), time.process_time()
        refused = await asyncio.gather(
            *(
                produce(client, c * in_flight + k)
                for c, client in enumerate(clients)
                for k in range(in_flight)
            )
        )
        cpu = time.process_time() - cpu
        results.put(("producers", started, time.monotonic(), sum(refused), cpu))
        for client in clients:
            client.close()

    asyncio.run(run())


def trainer_main(
    endpoint: str, total: int, batch_groups: int, results: Any, decode: bool = True
) -> None:
    """Takes batches until `total` trajectories came, acknowledging each at once. With
    `decode`, as the trainer does (every frame decoded in full); without, the frames
    as they come (the data plane alone), the latency read from each batch's first."""
    from rollwire.services.buffer.client import BufferTrainerClient
    from rollwire.services.core.wire import decode_trajectory

    client = BufferTrainerClient(endpoint, timeout=TIMEOUT)
    client.status()
    cpu = time.process_time()
    latencies = []
    received = 0
    while received < total:
        groups = min(batch_groups, (total - received) // GROUP_SIZE)
        if decode:
            batch = client.get_batch(0, groups, wait_seconds=1.0)
            if batch is None:
                continue
            batch_id, count = batch.batch_id, len(batch.trajectories)
            now = time.monotonic()
            latencies.extend(now - t.timings["put"] for t in batch.trajectories)
        else:
            served = client.get_frames(0, groups, wait_seconds=1.0)
            if served is None:
                continue
            header, frames = served
            batch_id, count = header.batch_id, len(frames)
            latencies.append(time.monotonic() - decode_trajectory(frames[0]).timings["put"])
        received += count
        client.ack(batch_id, 0)
    cpu = time.process_time() - cpu
    results.put(("trainer", time.monotonic(), np.array(latencies), cpu))
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


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    durable: bool = True
    sync: str = "batch"
    whole_groups: bool = False
    producers: int = 1
    in_flight: int = 1
    decode: bool = True
    records: int | None = None  # default: --records


def buffer_row(
    spawn: Any,
    root: Path,
    case: Case,
    records: int,
    batch_groups: int,
    tokens: int,
    profile: Path | None = None,
) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(dir=root))
    buffer, endpoints = start_buffer(scratch, case.durable, case.sync, profile)
    buffer_cpu = psutil.Process(buffer.pid).cpu_times()
    try:
        senders = case.producers * case.in_flight
        groups_each = max(1, records // (GROUP_SIZE * senders))
        total = groups_each * GROUP_SIZE * senders
        results = spawn.Queue()
        trainer = spawn.Process(
            target=trainer_main,
            args=(endpoints["trainer"], total, batch_groups, results, case.decode),
        )
        producer = spawn.Process(
            target=producers_main,
            args=(
                endpoints["producer"],
                case.producers,
                case.in_flight,
                groups_each,
                results,
                case.whole_groups,
                tokens,
            ),
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
        now = psutil.Process(buffer.pid).cpu_times()
        buffer_cpu = now.user + now.system - buffer_cpu.user - buffer_cpu.system
    finally:
        stop(buffer)
    started, _, refused, producer_cpu = got["producers"]
    ended, latencies, trainer_cpu = got["trainer"]
    if refused:
        raise RuntimeError(f"the buffer refused {refused} puts")
    size = len(encode(template(tokens)))
    return {
        "records": total,
        "seconds": ended - started,
        "bytes": total * size,
        "latency": latencies,
        "cpu": (producer_cpu, buffer_cpu, trainer_cpu),
    }


CASES = [
    Case("put, durable=false", durable=False, producers=8),
    Case("put, log_sync=batch", producers=8),
    Case("put, log_sync=always", sync="always", producers=8, records=-1),
    Case("put_group, durable=false", durable=False, whole_groups=True, in_flight=8),
    Case("put_group, log_sync=batch, 1 in flight", whole_groups=True),
    Case("put_group, log_sync=batch", whole_groups=True, in_flight=8),
    Case("put_group, log_sync=always", sync="always", whole_groups=True, in_flight=8),
    Case("put_group, log_sync=batch, frames", whole_groups=True, in_flight=8, decode=False),
]
"""Rows: a producer process with `producers` clients, each `in_flight` requests at
once; the trainer decoding every frame, or taking frames only ("frames")."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw-records", type=int, default=200_000, help="records per raw row")
    parser.add_argument("--records", type=int, default=16_000, help="records per buffer row")
    parser.add_argument(
        "--always-records", type=int, default=4_000, help="records for log_sync=always"
    )
    parser.add_argument("--batch-groups", type=int, default=8, help="groups of 8 per trainer batch")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the buffer's log goes (default: a temp dir)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=128,
        help="tokens a trajectory (a third prompt, the rest generated)",
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile the buffer process")
    parser.add_argument(
        "--only", default="", help="run only the buffer rows whose name contains this text"
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn = multiprocessing.get_context("spawn")
    rows = [
        (
            "raw PUSH/PULL, msgpack.packb in the loop",
            raw_row(spawn, args.raw_records, True, args.tokens),
        ),
        ("raw PUSH/PULL, pre-packed bytes", raw_row(spawn, args.raw_records, False, args.tokens)),
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        root = Path(scratch)
        for case in (c for c in CASES if args.only in c.name):
            records = args.always_records if case.records == -1 else args.records
            row = buffer_row(spawn, root, case, records, args.batch_groups, args.tokens)
            flight = f"{case.producers} x {case.in_flight} in flight"
            rows.append((f"buffer, {case.name} ({flight})", row))
        if args.profile:
            profile = root / "buffer.prof"
            headline = Case("profiled", whole_groups=True, in_flight=8)
            buffer_row(spawn, root, headline, args.records, args.batch_groups, args.tokens, profile)
            profiled = pstats.Stats(str(profile))
    packing, packed = rows[0][1], rows[1][1]
    packing_rate = packing["records"] / packing["seconds"]
    packed_rate = packed["records"] / packed["seconds"]
    size = len(encode(template(args.tokens)))
    print(
        f"payload: {size} bytes (wire-encoded {args.tokens}-token Trajectory), cores: {os.cpu_count()}"
    )
    print(f"trainer batches: {args.batch_groups} groups of {GROUP_SIZE}\n")
    print(
        "| case | records | records/s | MB/s | vs raw packing | vs raw pre-packed "
        "| put-to-batch p50 ms | p99 ms | CPU µs a record: producer / buffer / trainer |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, row in rows:
        rate = row["records"] / row["seconds"]
        megabytes = row["bytes"] / row["seconds"] / 1e6
        p50 = p99 = "n/a"
        if row["latency"] is not None:
            p50, p99 = (f"{ms:,.1f}" for ms in np.percentile(row["latency"], [50, 99]) * 1e3)
        cpu = "n/a"
        if row["cpu"] is not None:
            cpu = " / ".join(f"{seconds / row['records'] * 1e6:,.0f}" for seconds in row["cpu"])
        print(
            f"| {name} | {row['records']} | {rate:,.0f} | {megabytes:,.1f} "
            f"| {rate / packing_rate:.2f}x | {rate / packed_rate:.2f}x | {p50} | {p99} | {cpu} |"
        )
    if args.profile:
        print("\nbuffer process, durable log_sync=batch, under cProfile (tottime):\n")
        profiled.sort_stats("tottime").print_stats(20)
        profiled.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
