"""One full weight update, trainer to rollout-servers, against the bytes moved over loopback.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_sync.py [--mb 100] [--repeats 3]

A Qwen2-shaped model of about --mb MB (float32) is built offline. For 1 and 2
rollout-servers (each `rollwire rollout-server`, its own process, HF engine) the
trainer's own code path (`rollwire.trainer.process.weight_sender.publish`) sends a new version
to all of them at once, in chunks of 1, 4 and 16 MiB, and by gloo broadcast in a weight group
(`trainer.weights.transport: group`, formed before timing); a row's time runs from
the first chunk to the last server's acknowledgement, which comes once the
weights are copied into the served model (so it includes applying them).

The baseline moves the same bytes the plainest way: one TCP connection per
receiver process over loopback, `sendall` of the raw tensor bytes, the receiver
reading into a preallocated buffer; timed from the first byte to the last
receiver's one-byte reply. The ratio is update time over baseline time,
measured in the same run. On a 2-core machine the receivers share the cores
with the sender.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.services.core.tiny import TinySpec, ensure_tiny_model
from rollwire.trainer.process.weight_sender import GroupPublisher, publish

MiB = 1 << 20


def build_model(folder: Path, target_mb: float) -> tuple[Path, int]:
    """A tiny-tokenizer Qwen2 whose layers add up to about `target_mb` MB of float32."""
    hidden, intermediate = 512, 1408
    per_layer = 4 * (hidden * hidden * 2 + hidden * hidden // 2 * 2 + 3 * hidden * intermediate)
    layers = max(1, round(target_mb * 1e6 / per_layer))
    spec = TinySpec(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    path = ensure_tiny_model(folder / "model", spec)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return path, size


class Servers:
    """`rollwire rollout-server` processes on free ports; stopped by pid at exit."""

    def __init__(self, count: int, model: Path, work: Path) -> None:
        self.processes, self.addresses = [], []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for index in range(count):
            ready = work / f"ready-{count}-{index}"
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollwire.services.app.cli",
                    "rollout-server",
                    "--set",
                    f"rollout_server.model_path={model}",
                    "--set",
                    "rollout_server.server.max_message_bytes=134217728",
                    "--ready-file",
                    str(ready),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.processes.append(process)
            deadline = time.monotonic() + 120
            while not (ready.exists() and ready.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("a rollout-server did not start")
                time.sleep(0.1)
            self.addresses.append(ready.read_text().strip())

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


class _Policy:
    """What `publish` needs of the trainer's policy: its named weights."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self.model.named_parameters()]


async def time_updates(
    addresses: list[str],
    policy: _Policy,
    chunk: int,
    repeats: int,
    first_version: int,
    broadcast: bool = False,
) -> list[float]:
    """Seconds of each of `repeats` updates: gRPC streams of `chunk` bytes, or (`broadcast`)
    gloo broadcasts in a weight group formed first (trainer.weights.transport: group)."""
    channels = [open_channel(address) for address in addresses]
    group = None
    try:
        for address, channel in zip(addresses, channels, strict=True):
            await wait_for_serving(channel, timeout=60, target=address)
        stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in channels]
        if broadcast:
            group = await GroupPublisher.form(stubs, "127.0.0.1", "gloo", 300.0)
        times = []
        for repeat in range(repeats):
            version = first_version + repeat
            times.append(await publish(stubs, policy, version, chunk, timeout=300, group=group))
        if group is not None and not group.usable:
            raise SystemExit("the weight group failed during the benchmark")
        return times
    finally:
        if group is not None:
            group.close()
        for channel in channels:
            await channel.close()


def _receiver(port_queue, total: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    connection, _ = listener.accept()
    buffer = bytearray(total)
    view = memoryview(buffer)
    got = 0
    while got < total:
        got += connection.recv_into(view[got:], total - got)
    connection.sendall(b"k")
    connection.close()


def time_raw(payload: bytes, receivers: int) -> float:
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    processes = [
        context.Process(target=_receiver, args=(ports, len(payload))) for _ in range(receivers)
    ]
    for process in processes:
        process.start()
    sockets = [socket.create_connection(("127.0.0.1", ports.get(timeout=60))) for _ in processes]
    started = time.perf_counter()
    for connection in sockets:  # one after another, as one sender thread would
        connection.sendall(payload)
    for connection in sockets:
        connection.recv(1)
    elapsed = time.perf_counter() - started
    for connection in sockets:
        connection.close()
    for process in processes:
        process.join(timeout=30)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="model size in MB (100)")
    parser.add_argument("--repeats", type=int, default=3, help="updates per row (3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        model, size = build_model(work, args.mb)
        policy = _Policy(model)
        payload = b"".join(t.numpy().tobytes() for _, t in policy.named_weights())
        print(f"model: {size / 1e6:.1f} MB float32, {len(policy.named_weights())} tensors\n")
        rows = []
        version = 1
        for count in (1, 2):
            raw = statistics.median(time_raw(payload, count) for _ in range(args.repeats))
            servers = Servers(count, model, work)
            try:
                for chunk_mib in (1, 4, 16, "bcast"):
                    times = asyncio.run(
                        time_updates(
                            servers.addresses,
                            policy,
                            4 * MiB if chunk_mib == "bcast" else chunk_mib * MiB,
                            args.repeats,
                            version,
                            broadcast=chunk_mib == "bcast",
                        )
                    )
                    version += args.repeats
                    seconds = statistics.median(times)
                    rows.append((count, chunk_mib, seconds, raw))
            finally:
                servers.stop()
        header = (
            f"{'servers':>7} {'chunk MiB':>9} {'update s':>9} {'s per MB':>9} "
            f"{'MB/s sent':>9} {'raw s':>7} {'x raw':>6}"
        )
        print(header)
        print("-" * len(header))
        for count, chunk_mib, seconds, raw in rows:
            moved = size * count / 1e6
            print(
                f"{count:>7} {chunk_mib:>9} {seconds:>9.3f} {seconds / (size / 1e6):>9.4f} "
                f"{moved / seconds:>9.0f} {raw:>7.3f} {seconds / raw:>6.1f}"
            )
        print(
            "\nupdate s: median of the repeats, first chunk to the last server's answer "
            "(weights applied); raw s: the same bytes over one TCP socket per receiver; "
            "chunk 'bcast': gloo broadcasts in a weight group (trainer.weights.transport: group)."
        )
        json.dump(rows, sys.stderr)


if __name__ == "__main__":
    main()
