"""The buffer's trajectory log: what was acknowledged survives a restart, nothing twice."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import sys

import pytest

from rollwire.services.buffer.client import BufferProducer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from tests.helpers.servers import Running
from tests.helpers.trajectories import trajectory


@pytest.mark.integration
async def test_a_restarted_buffer_serves_what_it_had_and_nothing_consumed(tmp_path) -> None:
    first = Running(tmp_path)
    try:
        for group in ("a", "b", "c"):
            for i in range(2):
                assert (await first.producer.put(trajectory(group, i))).accepted
        trained = await asyncio.to_thread(first.trainer.get_batch, 0, 1, 1.0)
        await asyncio.to_thread(first.trainer.ack, trained.batch_id, 1)  # "a": consumed
        served = await asyncio.to_thread(first.trainer.get_batch, 1, 1, 1.0)  # "b": never acked
        assert [t.group_id for t in trained.trajectories + served.trajectories] == ["a"] * 2 + [
            "b"
        ] * 2
    finally:
        first.stop()

    second = Running(tmp_path)
    try:
        assert second.restored == 4  # b (served, unacknowledged) and c
        batch = await asyncio.to_thread(second.trainer.get_batch, 1, 2, 1.0)
        assert [t.trajectory_id for t in batch.trajectories] == ["b/0", "b/1", "c/0", "c/1"]
        # A producer retrying a consumed trajectory after the restart is not trained twice.
        assert (await second.producer.put(trajectory("a", 0))).reason == "duplicate"
        assert await asyncio.to_thread(second.trainer.get_batch, 1, 1, 0.2) is None
    finally:
        second.stop()


@pytest.mark.integration
async def test_stale_drops_are_consumed_and_segments_of_consumed_data_deleted(tmp_path) -> None:
    running = Running(tmp_path, segment_bytes=4096)
    try:
        for group in range(12):
            for i in range(2):
                assert (await running.producer.put(trajectory(f"g{group}", i))).accepted
        segments = len(running.log.log.segments)
        assert segments > 2
        for _ in range(6):
            batch = await asyncio.to_thread(running.trainer.get_batch, 0, 1, 1.0)
            await asyncio.to_thread(running.trainer.ack, batch.batch_id, 0)
        # Version 10, bound 5: the other six groups (version 0) are dropped as stale.
        assert await asyncio.to_thread(running.trainer.get_batch, 10, 1, 0.2) is None
        assert (await running.producer.status()).dropped == {"stale": 12}
        assert len(running.log.log.segments) < segments
    finally:
        running.stop()
    again = Running(tmp_path, segment_bytes=4096)
    try:
        assert again.restored == 0
        assert (await again.producer.put(trajectory("g11", 1))).reason == "duplicate"
    finally:
        again.stop()


@pytest.mark.integration
async def test_a_log_that_cannot_be_written_refuses_puts_until_it_can(
    tmp_path, monkeypatch
) -> None:
    running = Running(tmp_path)
    real_write = os.write
    failing = {"on": True}

    def disk_full(fd: int, data) -> int:
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    try:
        refused = await running.producer.put(trajectory("a", 0))
        assert not refused.accepted and refused.reason.startswith("storage: ")
        assert "No space left" in refused.reason
        assert (await running.producer.status()).accepted == 0
        failing["on"] = False
        assert (await running.producer.put(trajectory("a", 0))).reason == "ok"
    finally:
        running.stop()


CHILD = r"""
import json, sys, threading
from pathlib import Path
from rollwire.services.buffer.server import BufferServer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
state = BufferState(group_size=2, max_staleness=5)
trajectory_log = TrajectoryLog(Path(sys.argv[1]), sync="always")
trajectory_log.restore(state, 1 << 20)
server = BufferServer(state, trajectory_log=trajectory_log)
print(json.dumps(server.endpoints), flush=True)
server.serve(poll_ms=5)
"""


@pytest.mark.multiproc
async def test_every_acknowledged_put_survives_sigkill(tmp_path) -> None:
    import subprocess

    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    acknowledged: list[str] = []
    try:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 30)
        producer = BufferProducer(json.loads(line)["producer"], timeout=2, attempts=1)
        try:
            for group in range(40):
                for i in range(2):
                    if (await producer.put(trajectory(f"g{group}", i))).accepted:
                        acknowledged.append(f"g{group}/{i}")
                if group == 25:
                    os.killpg(process.pid, signal.SIGKILL)  # mid-run, between two puts
                    break
        finally:
            producer.close()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    state = BufferState(group_size=2, max_staleness=5)
    reopened = TrajectoryLog(tmp_path / "log")
    try:
        assert reopened.restore(state, 1 << 20) == len(acknowledged) == 52
        held = {t.trajectory_id for group in state.ready for t in group}
        assert held == set(acknowledged)
    finally:
        reopened.close()


@pytest.mark.integration
async def test_a_batch_trained_across_a_restart_is_acknowledged_by_its_ids(tmp_path) -> None:
    first = Running(tmp_path)
    try:
        for group in ("a", "b"):
            for i in range(2):
                assert (await first.producer.put(trajectory(group, i))).accepted
        batch = await asyncio.to_thread(first.trainer.get_batch, 0, 1, 1.0)
    finally:
        first.stop()  # the buffer goes away while the trainer trains on `batch`
    second = Running(tmp_path)
    try:
        ids = [t.trajectory_id for t in batch.trajectories]
        await asyncio.to_thread(second.trainer.ack, batch.batch_id, 1, ids)
        left = await asyncio.to_thread(second.trainer.get_batch, 1, 1, 1.0)
        assert [t.group_id for t in left.trajectories] == ["b", "b"]  # "a" is not served twice
        assert await asyncio.to_thread(second.trainer.get_batch, 1, 1, 0.2) is None
    finally:
        second.stop()


@pytest.mark.integration
async def test_a_group_goes_in_one_message_with_one_answer_each(tmp_path) -> None:
    running = Running(tmp_path)
    try:
        results = await running.producer.put_group([trajectory("g", 0), trajectory("g", 1)])
        assert [(r.accepted, r.reason) for r in results] == [(True, "ok"), (True, "ok")]
        again = await running.producer.put_group([trajectory("g", 1), trajectory("h", 7)])
        assert [r.reason for r in again] == ["duplicate", "sample_index 7 outside a group of 2"]
        batch = await asyncio.to_thread(running.trainer.get_batch, 0, 1, 1.0)
        assert [t.trajectory_id for t in batch.trajectories] == ["g/0", "g/1"]
    finally:
        running.stop()
