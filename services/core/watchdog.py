"""A watchdog: work that outlives its deadline is reported, with its trace id, instead
of hanging quietly (ARCHITECTURE.md, invariant 4).

    watchdog = Watchdog("orchestrator")
    watchdog.start()                       # checks every `period` seconds
    with watchdog.watch("group", "ordinal 17", seconds=300):
        ...                                # calls made here carry the trace id

Each watched piece of work gets a trace id: the current span's, or a fresh one
made current for the duration when no span is active (tracing off), so the
gRPC calls it makes carry the id in their metadata and the servers' log lines
carry it too. Work past its deadline is logged at warning level with its kind,
what it is, its age and trace id, counted in `watchdog_stuck{kind}`, and
reported again each time another deadline's length passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)


@dataclass
class Watched:
    kind: str
    what: str
    trace_id: str
    started: float
    seconds: float
    reports: int = 0

    def age(self, now: float) -> float:
        return now - self.started


def _fresh_span() -> NonRecordingSpan:
    ids = random.SystemRandom()
    context = SpanContext(
        trace_id=ids.getrandbits(128) or 1,
        span_id=ids.getrandbits(64) or 1,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.DEFAULT),
    )
    return NonRecordingSpan(context)


class Watchdog:
    def __init__(
        self, service: str, period: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.service = service
        self.period = period
        self.clock = clock
        self._watched: dict[int, Watched] = {}
        self._keys = itertools.count()
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watch(self, kind: str, what: str, seconds: float) -> Iterator[Watched]:
        """Watches the work inside the block; it is reported if it lasts past `seconds`."""
        span = trace.get_current_span()
        made = None
        if not span.get_span_context().is_valid:
            made = span = _fresh_span()
        entry = Watched(
            kind,
            what,
            format(span.get_span_context().trace_id, "032x"),
            self.clock(),
            seconds,
        )
        key = next(self._keys)
        self._watched[key] = entry
        try:
            if made is None:
                yield entry
            else:
                with trace.use_span(made, end_on_exit=False):
                    yield entry
        finally:
            del self._watched[key]
            if entry.reports:
                log.info(
                    "stuck work ended",
                    extra={
                        "kind": kind,
                        "what": what,
                        "trace_id": entry.trace_id,
                        "seconds": round(entry.age(self.clock()), 1),
                    },
                )

    @property
    def watched(self) -> list[Watched]:
        return list(self._watched.values())

    def check(self) -> list[Watched]:
        """Reports what is past its deadline (again after each further deadline's length)."""
        now = self.clock()
        late = []
        for entry in list(self._watched.values()):
            if entry.age(now) < entry.seconds * (entry.reports + 1):
                continue
            entry.reports += 1
            late.append(entry)
            COUNTERS.inc("watchdog_stuck", kind=entry.kind)
            log.warning(
                "stuck: %s %s has run %.0fs, past its %.0fs deadline",
                entry.kind,
                entry.what,
                entry.age(now),
                entry.seconds,
                extra={"kind": entry.kind, "what": entry.what, "trace_id": entry.trace_id},
            )
        return late

    def start(self) -> asyncio.Task[None]:
        """Checks every `period` seconds on the running loop until `stop`."""

        async def patrol() -> None:
            while True:
                await asyncio.sleep(self.period)
                self.check()

        self._task = asyncio.get_running_loop().create_task(patrol(), name="watchdog")
        return self._task

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
