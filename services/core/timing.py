"""Where a process's time goes: seconds per phase, and the CPU it used meanwhile.

Every run records these (the trainer per step, the orchestrator in its progress
reports) and `rollwire train` prints them at its end. Phases that overlap (concurrent
calls of an asyncio service) add up, so their sum can pass the wall time: it reads as
"seconds of calls in flight", and the CPU figure says how busy the process really was.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseClock:
    """Seconds per named phase since the last `take`, and the process's CPU time."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def times(self) -> dict[str, float]:
        """`time_<phase>_seconds` for each phase since the last `take`."""
        return {f"time_{name}_seconds": seconds for name, seconds in self.seconds.items()}

    def snapshot(self) -> dict[str, float]:
        """The `times`, with `wall_seconds`, `cpu_seconds` and `cpu_cores` (CPU seconds per
        wall second: 1.0 is one core kept busy), since the last `take`."""
        wall = max(time.perf_counter() - self._wall, 1e-9)
        cpu = time.process_time() - self._cpu
        return self.times() | {"wall_seconds": wall, "cpu_seconds": cpu, "cpu_cores": cpu / wall}

    def take(self) -> dict[str, float]:
        """The snapshot, then starts counting afresh."""
        out = self.snapshot()
        self.seconds.clear()
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return out
