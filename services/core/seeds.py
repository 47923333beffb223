"""A run's seeds: `run.seed` mixed into each random stream's own seed.

Every source of randomness in a run has a seed of its own setting (the order of the
training prompts, the samples' seeds, a rollout engine's generator, the trainer's
initialisation, an offline pipeline's row order). `run.seed` reaches all of them through
`stream_seed`: 0 leaves each as configured (what the measured runs in the documentation used);
any other value gives every stream a different seed, the same in every process and every
run with that value. The data itself (a dataset's generator seed, the held-out set) is
not a stream: runs with different seeds train on the same prompts, in another order, and
are measured on the same held-out set.
"""

from __future__ import annotations

import hashlib

STREAMS = ("data", "sampling", "engine", "init")
"""Prompt (or row) order; the seeds of sampled responses; a rollout engine's own
generator (requests without a seed); the trainer's weights initialised at start."""


def stream_seed(run_seed: int, stream: str, seed: int = 0) -> int:
    """The seed of `stream` in a run with `run.seed` = `run_seed`, where the stream's own
    setting is `seed`: `seed` itself when `run_seed` is 0, else a 31-bit mix of the three
    (what every engine takes: numpy's global seed and some int32 tensors stop at 2**32)."""
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}; streams: {STREAMS}")
    if run_seed == 0:
        return seed
    digest = hashlib.blake2b(f"{run_seed}/{stream}/{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 33
