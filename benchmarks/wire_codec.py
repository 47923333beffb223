"""Encode + decode speed of the trajectory wire format, against plain msgpack and pickle.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_codec.py

`wire` is rollwire's encode() + decode_trajectory() with full validation (the
header-first layout); `wire, first layout` the same with encode_map() (one msgpack map,
arrays inline); `msgpack raw` packs and unpacks the same fields with no checks; `pickle`
round-trips the dataclass. Ratios are throughput relative to msgpack raw, measured in the same run.
"""

from __future__ import annotations

import argparse
import pickle
import time

import msgpack
import numpy as np

from rollwire.services.core.wire import (
    Trajectory,
    _trajectory_body,
    decode_trajectory,
    encode,
    encode_map,
)


def trajectory(tokens: int, rng: np.random.Generator) -> Trajectory:
    mask = (rng.random(tokens) < 0.7).astype(np.uint8)
    return Trajectory(
        trajectory_id="t",
        group_id="g",
        task_id="task",
        sample_index=0,
        prompt_ordinal=1,
        source="bench",
        domain="math",
        token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -rng.random(tokens), 0).astype(np.float32),
        policy_versions=np.where(mask == 1, 5, -1).astype(np.int64),
        reward=1.0,
        reward_components={"correct": 1.0},
        timings={"generate": 1.0},
    )


def rate(function, repeats: int) -> float:
    """Round trips per second, best of three bursts."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            function()
        best = min(best, time.perf_counter() - started)
    return repeats / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{'tokens':>7}{'frame KiB':>11}{'codec':>20}{'round trips/s':>15}{'MB/s':>9}{'vs raw':>8}"
    )
    for tokens in (256, 4096, 32768):
        item = trajectory(tokens, rng)
        frame = encode(item)
        body = _trajectory_body(item)
        repeats = max(20, args.repeats * 256 // tokens)
        raw = rate(
            lambda body=body: msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False),
            repeats,
        )
        rows = [
            ("msgpack raw", raw),
            ("wire", rate(lambda item=item: decode_trajectory(encode(item)), repeats)),
            (
                "wire, first layout",
                rate(lambda item=item: decode_trajectory(encode_map(item)), repeats),
            ),
            ("pickle", rate(lambda item=item: pickle.loads(pickle.dumps(item)), repeats)),
        ]
        for name, per_second in rows:
            megabytes = per_second * len(frame) / 1e6
            print(
                f"{tokens:>7}{len(frame) / 1024:>11.1f}{name:>20}{per_second:>15.0f}{megabytes:>9.0f}{per_second / raw:>7.2f}x"
            )


if __name__ == "__main__":
    main()
