"""The watchdog: late work is reported with its trace id, which the calls made inside
the watched block carry to the servers."""

from __future__ import annotations

import asyncio
import logging

import pytest
from opentelemetry import trace

from rollwire.proto.v1 import trainer_pb2, trainer_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import Registration
from rollwire.services.core.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def current_trace_id() -> str:
    return format(trace.get_current_span().get_span_context().trace_id, "032x")


def test_late_work_is_reported_once_per_deadline_with_its_trace_id(caplog) -> None:
    clock = Clock()
    watchdog = Watchdog("test", clock=clock)
    before = COUNTERS.get("watchdog_stuck", kind="group")
    with caplog.at_level(logging.WARNING, "rollwire.services.core.watchdog"):
        with watchdog.watch("group", "ordinal 7", seconds=10) as entry:
            assert len(entry.trace_id) == 32 and entry.trace_id == current_trace_id()
            clock.now += 9
            assert watchdog.check() == []
            clock.now += 2
            assert watchdog.check() == [entry]
            clock.now += 5
            assert watchdog.check() == []  # reported; not again until another 10 s pass
            clock.now += 5
            assert watchdog.check() == [entry]
        assert not trace.get_current_span().get_span_context().is_valid
        assert watchdog.watched == []
    assert COUNTERS.get("watchdog_stuck", kind="group") == before + 2
    (first, _) = [r for r in caplog.records if r.msg.startswith("stuck")]
    assert first.getMessage() == "stuck: group ordinal 7 has run 11s, past its 10s deadline"
    assert first.trace_id == entry.trace_id


def test_an_active_span_lends_its_trace_id() -> None:
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    outer = NonRecordingSpan(SpanContext(0xABC, 0xDEF, False, TraceFlags(1)))
    with (
        trace.use_span(outer, end_on_exit=False),
        Watchdog("test").watch("request", "r1", 5) as entry,
    ):
        assert entry.trace_id == format(0xABC, "032x")


class Recording(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self) -> None:
        self.trace_ids: list[str] = []

    async def GetVersion(self, request, context):
        self.trace_ids.append(current_trace_id())
        return trainer_pb2.VersionResponse(policy_version=1)


@pytest.mark.integration
async def test_the_patrol_reports_stuck_tasks_and_calls_carry_the_trace_id(
    start_service, caplog
) -> None:
    servicer = Recording()
    runtime = await start_service(
        [
            Registration(
                trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                servicer,
                "rollwire.v1.TrainerService",
            )
        ]
    )
    watchdog = Watchdog("test", period=0.05)
    watchdog.start()
    release = asyncio.Event()

    async def stuck_group() -> str:
        with watchdog.watch("group", "ordinal 3", seconds=0.1) as entry:
            async with open_channel(runtime.address) as channel:
                await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(
                    trainer_pb2.VersionRequest()
                )
            await release.wait()
            return entry.trace_id

    try:
        with caplog.at_level(logging.WARNING, "rollwire.services.core.watchdog"):
            task = asyncio.ensure_future(stuck_group())
            for _ in range(100):
                if any(r.msg.startswith("stuck") for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            release.set()
            trace_id = await asyncio.wait_for(task, 5)
    finally:
        watchdog.stop()
    reports = [r for r in caplog.records if r.msg.startswith("stuck")]
    assert reports and reports[0].trace_id == trace_id and reports[0].what == "ordinal 3"
    assert servicer.trace_ids == [trace_id], "the server saw another trace"
