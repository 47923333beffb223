"""An environment whose steps take a heavy-tailed time, like tool calls, web requests
or code execution in agentic RL. A plugin for `benchmarks/agentic_long_tail.py`:

    PYTHONPATH=benchmarks rollwire train --set 'env_server.plugins=[long_tail_env]' \\
        --set 'orchestrator.dataset={type: env, env_id: long_tail, env_kwargs: {median_ms: 200}}'

Each `step` sleeps a latency drawn from a lognormal distribution with median
`median_ms` and log-standard-deviation `tail` (0: every step takes exactly the
median; 1: one step in a hundred takes ~10x the median; 1.5: ~33x). The draws
are seeded from the reset seed and from how many sessions this process has
opened with that seed before, so the episodes of one group (which share a
seed) draw different latencies, and a run in sync mode and one in async mode
see the same draws for the same group. Any action is accepted; a turn whose
action contains a digit earns 1 / turns, so rewards vary within a group.
`blocking = True`: the env-server runs steps in its thread pool, off its
event loop.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from typing import Any

from rollwire.envs.base import Env, StepResult
from rollwire.envs.registry import register

_opened: Counter[int | None] = Counter()
_opened_lock = threading.Lock()


class LongTail(Env):
    """A few turns of anything; each step waits a lognormal latency."""

    blocking = True

    def __init__(self, median_ms: float = 200.0, tail: float = 1.0, turns: int = 3) -> None:
        if median_ms < 0 or tail < 0 or turns < 1:
            raise ValueError("need median_ms >= 0, tail >= 0 and turns >= 1")
        self.median_ms, self.tail, self.turns = float(median_ms), float(tail), int(turns)
        self._rng = random.Random(0)
        self._turn = 0

    def latency_seconds(self) -> float:
        """The next step's latency: median * exp(tail * N(0, 1))."""
        return self.median_ms / 1000.0 * math.exp(self.tail * self._rng.gauss(0.0, 1.0))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        with _opened_lock:
            replica = _opened[seed]
            _opened[seed] += 1
        self._rng = random.Random(f"long_tail/{seed}/{replica}")
        self._turn = 0
        return f"Turn 1 of {self.turns}: say something with a number in it.", {}

    def step(self, action: str) -> StepResult:
        time.sleep(self.latency_seconds())
        self._turn += 1
        reward = 1.0 / self.turns if any(c.isdigit() for c in action) else 0.0
        done = self._turn >= self.turns
        observation = "done" if done else f"Turn {self._turn + 1} of {self.turns}: again."
        return observation, reward, done, False, {"turn": self._turn}


register(
    "long_tail",
    LongTail,
    "A few turns of anything; each step sleeps a heavy-tailed (lognormal) latency.",
    domain="tool",
)
