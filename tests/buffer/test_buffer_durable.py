"""The buffer's trajectory log: what was acknowledged survives a restart, nothing twice."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rollwire.services.buffer.client import BufferProducer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from rollwire.services.core.metrics import COUNTERS
from tests.helpers.servers import Running
from tests.helpers.trajectories import latent_trajectory, trajectory


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
async def test_latent_trajectories_survive_a_restart_whole_once_and_age_by_their_steps(
    tmp_path,
) -> None:
    """A diffusion sample's frame (its steps as tokens, its latents in `tensors`) is held,
    logged, served and restored as any other: nothing consumed comes back, nothing
    acknowledged is lost, and its oldest recorded step decides its staleness."""
    sent = {(g, i): latent_trajectory(g, i) for g in ("la", "lb") for i in range(2)}
    first = Running(tmp_path)
    try:
        for item in sent.values():
            assert (await first.producer.put(item)).accepted
        trained = await asyncio.to_thread(first.trainer.get_batch, 1, 1, 1.0)
        await asyncio.to_thread(first.trainer.ack, trained.batch_id, 1)
        assert trained.trajectories == [sent["la", 0], sent["la", 1]]
    finally:
        first.stop()
    second = Running(tmp_path)
    try:
        assert second.restored == 2
        batch = await asyncio.to_thread(second.trainer.get_batch, 1, 1, 1.0)
        assert batch.trajectories == [sent["lb", 0], sent["lb", 1]]
        assert batch.trajectories[0].tensors["latents"].shape == (4, 1, 8, 8)
        assert (await second.producer.put(sent["la", 0])).reason == "duplicate"
        # Steps taken by versions 0, 0 and 1: at trainer version 6 (bound 5) the oldest,
        # 0, is too old, whatever the newest step was.
        for i in range(2):
            assert (await second.producer.put(latent_trajectory("lc", i))).accepted
        assert await asyncio.to_thread(second.trainer.get_batch, 6, 1, 0.2) is None
        assert (await second.producer.status()).dropped == {"stale": 2}
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
    real_write = os.writev
    failing = {"on": True}

    def disk_full(fd: int, pieces) -> int:
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, pieces)

    monkeypatch.setattr(os, "writev", disk_full)
    try:
        refused = await running.producer.put(trajectory("a", 0))
        assert not refused.accepted and refused.reason.startswith("storage: ")
        assert "No space left" in refused.reason
        assert (await running.producer.status()).accepted == 0
        failing["on"] = False
        assert (await running.producer.put(trajectory("a", 0))).reason == "ok"
    finally:
        running.stop()


@pytest.mark.integration
async def test_a_burst_whose_fsync_fails_is_refused_and_taken_when_sent_again(
    tmp_path, monkeypatch
) -> None:
    """After a failed fsync what was written may be gone whatever a read shows: the
    burst's puts are refused ("storage: ..."), the buffer reopens its log, and a resend is
    taken. Nothing acknowledged is lost and nothing is held twice across a restart."""
    running = Running(tmp_path)
    real_fsync = os.fsync
    failing = {"on": False}

    def fsync(fd: int) -> None:
        if failing["on"]:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        assert (await running.producer.put(trajectory("a", 0))).reason == "ok"
        failing["on"] = True
        refused = await running.producer.put_group([trajectory("b", 0), trajectory("b", 1)])
        assert [r.accepted for r in refused] == [False, False]
        assert all(r.reason.startswith("storage: ") and "Input/output" in r.reason for r in refused)
        assert (await running.producer.status()).accepted == 1  # the buffer still answers
        failing["on"] = False
        deadline = time.monotonic() + 10  # a broken log is reopened at most once a second
        while True:
            answers = await running.producer.put_group([trajectory("b", 0), trajectory("b", 1)])
            if all(a.reason == "ok" for a in answers):
                break
            assert all(a.wait_and_retry for a in answers), answers
            assert time.monotonic() < deadline, answers
            await asyncio.sleep(0.2)
        assert (await running.producer.put(trajectory("a", 1))).reason == "ok"
    finally:
        running.stop()
    again = Running(tmp_path)
    try:
        assert again.restored == 4
        batch = await asyncio.to_thread(again.trainer.get_batch, 0, 2, 1.0)
        assert sorted(t.trajectory_id for t in batch.trajectories) == ["a/0", "a/1", "b/0", "b/1"]
    finally:
        again.stop()


@pytest.mark.integration
async def test_log_sync_never_fsyncs_nothing_and_batch_once_a_burst(tmp_path, monkeypatch) -> None:
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for sync, most in (("never", 0), ("batch", 3)):
        running = Running(tmp_path / sync, sync=sync)
        try:
            calls["n"] = 0
            for group in ("a", "b", "c"):
                answers = await running.producer.put_group([trajectory(group, i) for i in (0, 1)])
                assert [a.reason for a in answers] == ["ok", "ok"]
            assert 0 < calls["n"] <= most if most else calls["n"] == 0, (sync, calls["n"])
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


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs mounted for the test (root only) and unmounted after it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path) -> None:
    """Writes `path` until its file system has no space left."""
    with open(path, "wb", buffering=0) as file:
        while True:
            try:
                file.write(b"\0" * 4096)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                return


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_log_on_a_disk_that_fills_up_loses_nothing_acknowledged(small_disk) -> None:
    """A buffer's log on a real (small) file system that fills mid-run: producers wait
    while it is full and go on once space returns, or stop with a message that says
    why; every acknowledged trajectory survives a restart and is served once."""
    from rollwire.rollout.orchestrator.pacing import put_group_with_backpressure

    groups = [f"g{n}" for n in range(40)]
    running = Running(small_disk / "log", segment_bytes=16 * 1024)
    acked: list[str] = []

    async def put(names: list[str], timeout: float) -> None:
        for name in names:
            answers = await put_group_with_backpressure(
                running.producer, [trajectory(name, i) for i in (0, 1)], timeout
            )
            assert [a.reason for a in answers] == ["ok", "ok"], answers
            acked.extend(f"{name}/{i}" for i in (0, 1))

    try:
        await put(groups[:10], 10)
        fill(small_disk / "filler")
        waits = COUNTERS.get("orchestrator_backpressure_waits", reason="storage")
        producing = asyncio.ensure_future(put(groups[10:], 60))
        deadline = time.monotonic() + 20
        while COUNTERS.get("orchestrator_backpressure_waits", reason="storage") == waits:
            assert not producing.done() and time.monotonic() < deadline, "the disk never filled"
            await asyncio.sleep(0.05)
        assert (await running.producer.status()).accepted == len(acked)  # still serving
        (small_disk / "filler").unlink()  # space returns: the producer goes on by itself
        await asyncio.wait_for(producing, 60)
        assert len(acked) == 80

        # Full again and not freed: the producer gives up with the reason, not silence.
        fill(small_disk / "filler")
        with pytest.raises(TimeoutError, match="No space left on device"):
            await put([f"late{n}" for n in range(40)], 1.5)
    finally:
        running.stop()
    (small_disk / "filler").unlink()
    again = Running(small_disk / "log", segment_bytes=16 * 1024)
    try:
        assert again.restored == len(acked)
        served: list[str] = []
        while len(served) < len(acked):
            batch = await asyncio.to_thread(again.trainer.get_batch, 0, 1, 1.0)
            assert batch is not None, f"{len(served)} of {len(acked)} served"
            served.extend(t.trajectory_id for t in batch.trajectories)
            await asyncio.to_thread(again.trainer.ack, batch.batch_id, 0)
        assert sorted(served) == sorted(acked)
    finally:
        again.stop()
