"""Math items per second through the reward-server against math-verify in-process.

    .venv/bin/python benchmarks/math_scoring.py [--items 2000] [--batch 64] [--workers 1 2]

The same items both ways: answers to sums, fractions and LaTeX expressions, half right,
with and without `<answer>` tags. `in-process` is math-verify's `parse` + `verify` in a
loop in this process on what the `math` domain parses (the tagged answer, else the whole
response): the baseline; `reward-server` sends them in batches of `--batch`
to a `rollwire reward-server` with `--workers` scorer processes over gRPC on loopback.
Ratios are against the in-process rate measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from math_verify import parse, verify

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc
from rollwire.reward.scorers import extract_answer
from rollwire.services.core.client import open_channel


def items(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(reference, response) pairs."""
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        a, b = rng.randint(1, 99), rng.randint(2, 9)
        kind = i % 4
        if kind == 0:
            reference, answer = str(a + b), str(a + b + rng.choice((0, 1)))
        elif kind == 1:
            reference, answer = (
                f"\\frac{{{a}}}{{{b}}}",
                f"{a / b:.6f}" if rng.random() < 0.5 else f"{a}/{b + 1}",
            )
        elif kind == 2:
            reference, answer = f"${a}\\sqrt{{{b}}}$", f"\\boxed{{{a}\\sqrt{{{b}}}}}"
        else:
            reference, answer = (
                f"x^2 + {2 * a}x + {a * a}",
                f"$(x+{a})^2$" if rng.random() < 0.5 else f"$(x-{a})^2$",
            )
        response = f"so <answer>{answer}</answer>" if i % 2 else f"The answer is {answer}."
        pairs.append((reference, response))
    return pairs


def in_process(pairs: list[tuple[str, str]]) -> tuple[float, float]:
    started = time.perf_counter()
    correct = 0
    for reference, response in pairs:
        tagged = extract_answer(response)  # what the math domain parses, as it does
        correct += bool(verify(parse(reference), parse(response if tagged is None else tagged)))
    return time.perf_counter() - started, correct / len(pairs)


def start_server(workers: int, scratch: Path) -> tuple[subprocess.Popen, str]:
    ready = scratch / f"ready-{workers}"
    command = [
        sys.executable, "-m", "rollwire.services.app.cli", "reward-server",
        "--port", "0", "--ready-file", str(ready),
        "--set", f"reward_server.workers={workers}", "--set", "telemetry.log_level=warning",
        "--set", "reward_server.max_batch_items=4096",
    ]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the reward-server did not start: {' '.join(command)}")
        time.sleep(0.05)
    return process, ready.read_text().strip()


async def through_server(
    address: str, pairs: list[tuple[str, str]], batch: int
) -> tuple[float, float, int]:
    async with open_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        warm = [reward_pb2.ScoreItem(item_id="w", domain="math", response="1", reference="1")]
        await stub.Score(reward_pb2.ScoreRequest(items=warm), timeout=120)  # workers started
        started = time.perf_counter()
        rewards, errors = [], 0
        for first in range(0, len(pairs), batch):
            request = reward_pb2.ScoreRequest(
                items=[
                    reward_pb2.ScoreItem(item_id=str(i), domain="math", response=s, reference=r)
                    for i, (r, s) in enumerate(pairs[first : first + batch])
                ]
            )
            reply = await stub.Score(request, timeout=600)
            rewards += [result.reward for result in reply.results]
            errors += sum(result.error for result in reply.results)
        return time.perf_counter() - started, sum(rewards) / len(rewards), errors


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--items", type=int, default=2000)
    options.add_argument("--batch", type=int, default=64)
    options.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = options.parse_args()
    pairs = items(args.items)
    in_process(pairs[:50])  # imports and caches
    seconds, accuracy = in_process(pairs)
    baseline = len(pairs) / seconds
    print(f"{len(pairs)} items, batches of {args.batch}\n")
    print("| path | workers | items/s | vs in-process | mean reward | errors |")
    print("|---|---|---|---|---|---|")
    print(f"| in-process math-verify | - | {baseline:.0f} | 1.00x | {accuracy:.3f} | - |")
    with tempfile.TemporaryDirectory() as scratch:
        for workers in args.workers:
            process, address = start_server(workers, Path(scratch))
            try:
                seconds, mean, errors = asyncio.run(through_server(address, pairs, args.batch))
            finally:
                process.terminate()
                process.wait(30)
            rate = len(pairs) / seconds
            print(
                f"| reward-server | {workers} | {rate:.0f} | {rate / baseline:.2f}x | {mean:.3f} | {errors} |"
            )


if __name__ == "__main__":
    main()
