"""The durable log: round trips, recovery from torn tails, refusal of real corruption, write errors."""

from __future__ import annotations

import errno
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollwire.services.buffer.durable_log import (
    HEADER_BYTES,
    DurableLog,
    LogCorrupted,
    LogLocked,
    LogWriteError,
    OffsetOutOfRange,
    encode_record,
    segment_name,
)
from rollwire.services.core.metrics import COUNTERS


def payload(index: int) -> bytes:
    """Distinct payloads of varying length (0 to 60 bytes)."""
    return (f"record {index};" * (index % 5)).encode()


def contents(log: DurableLog, start: int | None = None) -> list[tuple[int, bytes]]:
    return list(log.replay(start))


def fill(directory: Path, count: int, segment_bytes: int = 200, sync="never") -> None:
    with DurableLog(directory, segment_bytes=segment_bytes, sync=sync) as log:
        for index in range(count):
            assert log.append(payload(index)) == index


def test_round_trip_across_roll_overs_and_reopen(tmp_path) -> None:
    with DurableLog(tmp_path, segment_bytes=200, sync="always") as log:
        assert (log.first_offset, log.next_offset) == (0, 0)
        offsets = [log.append(payload(i)) for i in range(10)]
        offsets += log.append_many(payload(i) for i in range(10, 30))
        assert offsets == list(range(30))
        assert len(log.segments) > 2
        assert contents(log) == [(i, payload(i)) for i in range(30)]
    names = sorted(p.name for p in tmp_path.glob("segment-*.log"))
    assert names[0] == segment_name(0) == "segment-00000000000000000000.log"
    with DurableLog(tmp_path, segment_bytes=200) as log:
        assert log.next_offset == 30
        assert contents(log) == [(i, payload(i)) for i in range(30)]
        assert contents(log, 17) == [(i, payload(i)) for i in range(17, 30)]
        assert contents(log, 30) == []


def test_segments_roll_over_before_a_batch_that_would_not_fit(tmp_path) -> None:
    record = HEADER_BYTES + 10
    with DurableLog(tmp_path, segment_bytes=3 * record, sync="never") as log:
        log.append_many([b"x" * 10] * 2)
        log.append_many([b"y" * 10] * 2)  # 4 records would overflow: a new segment
        log.append_many([b"z" * 10] * 5)  # larger than a segment: gets one to itself
        sizes = [p.stat().st_size for p in log.segments]
        assert [p.name for p in log.segments] == [segment_name(o) for o in (0, 2, 4)]
        assert sizes == [2 * record, 2 * record, 5 * record]


def test_offsets_continue_after_reopen(tmp_path) -> None:
    fill(tmp_path, 5)
    with DurableLog(tmp_path, segment_bytes=200, sync="batch") as log:
        assert log.append(b"after") == 5
        assert log.append_many([b"a", b"b"]) == [6, 7]
        assert log.append_many([]) == []
    with DurableLog(tmp_path) as log:
        assert contents(log)[5:] == [(5, b"after"), (6, b"a"), (7, b"b")]


def test_torn_tail_at_every_cut_point_of_the_last_record(tmp_path) -> None:
    fill(tmp_path, 5, segment_bytes=10_000)
    segment = tmp_path / segment_name(0)
    whole = segment.read_bytes()
    last = len(encode_record(payload(4)))
    assert last > HEADER_BYTES
    for cut in range(len(whole) - last, len(whole)):  # 0 .. last-1 bytes of the last record kept
        segment.write_bytes(whole[:cut])
        before = COUNTERS.get("durable_log_torn_tails")
        with DurableLog(tmp_path, sync="never") as log:
            assert contents(log) == [(i, payload(i)) for i in range(4)], cut
            assert log.next_offset == 4
        expected = 0 if cut == len(whole) - last else 1
        assert COUNTERS.get("durable_log_torn_tails") - before == expected, cut
        assert segment.stat().st_size == len(whole) - last


def test_a_torn_tail_in_a_later_segment_keeps_earlier_segments(tmp_path) -> None:
    fill(tmp_path, 20)
    with DurableLog(tmp_path, segment_bytes=200) as log:
        last_segment = log.segments[-1]
        first_of_last = int(last_segment.name[8:28])
    data = last_segment.read_bytes()
    last_segment.write_bytes(data[:-3])
    with DurableLog(tmp_path, segment_bytes=200) as log:
        assert contents(log) == [(i, payload(i)) for i in range(19)]
        assert log.append(b"again") == 19
    assert first_of_last <= 19


@pytest.mark.parametrize("where", ["header", "payload", "crc field", "magic"])
def test_a_flipped_byte_in_the_last_record_drops_it_and_counts(tmp_path, where, caplog) -> None:
    fill(tmp_path, 4, segment_bytes=10_000)
    segment = tmp_path / segment_name(0)
    data = bytearray(segment.read_bytes())
    start = len(data) - len(encode_record(payload(3)))
    data[start + {"magic": 1, "header": 5, "crc field": 9, "payload": HEADER_BYTES + 2}[where]] ^= (
        0x40
    )
    segment.write_bytes(bytes(data))
    before = COUNTERS.get("durable_log_torn_tails")
    with DurableLog(tmp_path) as log:
        assert contents(log) == [(i, payload(i)) for i in range(3)]
        assert log.append(b"new") == 3
    assert COUNTERS.get("durable_log_torn_tails") == before + 1
    assert "dropping a torn record" in caplog.text and segment.name in caplog.text


def test_garbage_after_the_last_record_is_a_torn_tail(tmp_path) -> None:
    fill(tmp_path, 3, segment_bytes=10_000)
    segment = tmp_path / segment_name(0)
    size = segment.stat().st_size
    with segment.open("ab") as file:
        file.write(b"\0" * 4096)  # what a crash after an extending write can leave
    with DurableLog(tmp_path) as log:
        assert contents(log) == [(i, payload(i)) for i in range(3)]
    assert segment.stat().st_size == size


@pytest.mark.parametrize("where", [1, 6, HEADER_BYTES + 1])
def test_a_flipped_byte_in_an_earlier_record_is_corruption(tmp_path, where) -> None:
    fill(tmp_path, 4, segment_bytes=10_000)
    segment = tmp_path / segment_name(0)
    data = bytearray(segment.read_bytes())
    position = len(encode_record(payload(0)))  # record 1 starts here
    data[position + where] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorrupted) as raised:
        DurableLog(tmp_path)
    assert raised.value.path == segment and raised.value.position == position
    assert str(segment) in str(raised.value) and f"byte {position}" in str(raised.value)
    assert "record 1" in str(raised.value)
    assert segment.read_bytes() == bytes(data)  # nothing was "repaired"
    with pytest.raises(LogCorrupted):  # the failed open released the lock: same answer again
        DurableLog(tmp_path)


def test_damage_in_a_middle_segment_is_corruption_even_at_its_end(tmp_path) -> None:
    fill(tmp_path, 30)
    middle = sorted(tmp_path.glob("segment-*.log"))[1]
    data = middle.read_bytes()
    middle.write_bytes(data[:-1])  # a torn tail, but not in the last segment
    with pytest.raises(LogCorrupted, match="not the last segment") as raised:
        DurableLog(tmp_path, segment_bytes=200)
    assert raised.value.path == middle


def test_a_missing_middle_segment_is_corruption(tmp_path) -> None:
    fill(tmp_path, 30)
    segments = sorted(tmp_path.glob("segment-*.log"))
    assert len(segments) >= 3
    segments[1].unlink()
    with pytest.raises(LogCorrupted, match="missing") as raised:
        DurableLog(tmp_path)
    assert raised.value.path == segments[2]


def test_truncate_before_deletes_only_whole_old_segments(tmp_path) -> None:
    fill(tmp_path, 30)
    with DurableLog(tmp_path, segment_bytes=200) as log:
        firsts = [int(p.name[8:28]) for p in log.segments]
        assert log.truncate_before(firsts[1] - 1) == 0  # segment 0 still holds an offset >= it
        assert log.truncate_before(firsts[2]) == 2
        assert log.first_offset == firsts[2]
        assert contents(log) == [(i, payload(i)) for i in range(firsts[2], 30)]
        with pytest.raises(OffsetOutOfRange, match="truncate_before"):
            log.replay(firsts[2] - 1)
        with pytest.raises(OffsetOutOfRange, match="past the end"):
            log.replay(31)
        remaining = len(log.segments)
        assert log.truncate_before(10**9) == remaining - 1
        assert len(log.segments) == 1  # the segment being written stays
        assert log.append(b"next") == 30
    with DurableLog(tmp_path) as log:  # offsets survive the deletion
        assert log.first_offset == firsts[-1]
        assert contents(log)[-1] == (30, b"next")
        assert log.next_offset == 31


def test_disk_full_midway_through_a_write(tmp_path, monkeypatch) -> None:
    log = DurableLog(tmp_path, segment_bytes=10_000, sync="always")
    log.append_many([payload(i) for i in range(3)])
    size = log.segments[-1].stat().st_size
    real_write = os.write
    calls = []

    def half_then_full(fd: int, pieces) -> int:
        data = b"".join(bytes(piece) for piece in pieces)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2 + 3])  # ends inside a piece
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "writev", half_then_full)
        with pytest.raises(LogWriteError, match="No space left") as raised:
            log.append_many([b"a" * 500, b"b" * 500])
    assert len(calls) == 2, "the first write was partial, the second failed"
    assert calls[1] == calls[0] - (calls[0] // 2 + 3), "the second went on where the first ended"
    assert raised.value.errno == errno.ENOSPC and str(tmp_path) in str(raised.value)
    assert log.segments[-1].stat().st_size == size  # the half record was cut off
    assert log.next_offset == 3
    assert log.append(b"after space freed") == 3  # a retry works
    log.close()
    with DurableLog(tmp_path) as reopened:
        assert contents(reopened) == [
            *[(i, payload(i)) for i in range(3)],
            (3, b"after space freed"),
        ]


def test_short_writes_go_on_where_they_ended(tmp_path, monkeypatch) -> None:
    """A record's pieces (its header, a type byte, a frame held elsewhere) go out in one
    gathered write; when the system takes only part of it, the rest follows, from the
    middle of a piece if need be, and the log reads back whole."""
    real_write = os.write
    taken = []

    def a_few_bytes_at_a_time(fd: int, pieces) -> int:
        data = b"".join(bytes(piece) for piece in pieces)
        taken.append(min(len(data), 7))
        return real_write(fd, data[:7])

    records = [(b"T", memoryview(b"frame-%d" % i * 9)) for i in range(3)] + [b"plain", b""]
    with monkeypatch.context() as patch:
        patch.setattr(os, "writev", a_few_bytes_at_a_time)
        log = DurableLog(tmp_path, sync="always")
        assert log.append_many(records) == [0, 1, 2, 3, 4]
    assert sum(taken) == log.segments[-1].stat().st_size and len(taken) > 10
    log.close()
    with DurableLog(tmp_path) as reopened:
        assert [body for _, body in contents(reopened)] == [
            *(b"T" + b"frame-%d" % i * 9 for i in range(3)),
            b"plain",
            b"",
        ]


def test_a_read_only_directory_at_roll_over(tmp_path, monkeypatch) -> None:
    # Root ignores permissions, so the EROFS a read-only mount gives is simulated.
    log = DurableLog(tmp_path, segment_bytes=100, sync="batch")
    log.append(b"x" * 80)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", read_only)
        with pytest.raises(LogWriteError, match="Read-only file system") as raised:
            log.append(b"y" * 80)
    assert str(tmp_path) in str(raised.value) and raised.value.errno == errno.EROFS
    assert log.next_offset == 1 and len(log.segments) == 1
    assert log.append(b"z" * 80) == 1
    log.close()
    with DurableLog(tmp_path) as reopened:
        assert contents(reopened) == [(0, b"x" * 80), (1, b"z" * 80)]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a mode-0500 directory regardless")
def test_an_unwritable_directory_is_refused_on_open(tmp_path) -> None:
    directory = tmp_path / "log"
    directory.mkdir(mode=0o500)
    try:
        with pytest.raises(LogWriteError, match="Permission denied") as raised:
            DurableLog(directory)
        assert str(directory) in str(raised.value)
    finally:
        directory.chmod(0o700)


def test_opening_where_the_lock_cannot_be_created_is_a_write_error(tmp_path, monkeypatch) -> None:
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if Path(path).name == "LOCK":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(LogWriteError, match="Permission denied") as raised:
        DurableLog(tmp_path)
    assert str(tmp_path) in str(raised.value) and raised.value.errno == errno.EACCES


def test_a_failed_fsync_refuses_further_appends_until_reopened(tmp_path, monkeypatch) -> None:
    log = DurableLog(tmp_path, sync="always")
    log.append(b"kept")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(LogWriteError, match="fsync"):
            log.append(b"unsure")
    with pytest.raises(LogWriteError, match="reopen"):
        log.append(b"refused")
    log.close()
    with DurableLog(tmp_path) as reopened:
        assert contents(reopened)[0] == (0, b"kept")
        assert reopened.append(b"fine") == reopened.next_offset - 1


def test_one_writer_per_directory(tmp_path) -> None:
    first = DurableLog(tmp_path)
    with pytest.raises(LogLocked, match=f"pid {os.getpid()}") as raised:
        DurableLog(tmp_path)
    assert str(tmp_path) in str(raised.value)
    first.close()
    first.close()  # twice is fine
    with DurableLog(tmp_path) as second:
        assert second.next_offset == 0


def test_a_second_process_is_refused_the_lock(tmp_path) -> None:
    with DurableLog(tmp_path):
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from rollwire.services.buffer.durable_log import DurableLog, LogLocked\n"
                "try: DurableLog(sys.argv[1])\n"
                "except LogLocked as e: print(e); sys.exit(3)\n",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert child.returncode == 3, child.stderr
    assert "in use by another writer" in child.stdout


def test_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="sync"):
        DurableLog(tmp_path, sync="sometimes")  # type: ignore[arg-type]
    with DurableLog(tmp_path) as log, pytest.raises(ValueError):
        log.truncate_before(-1)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.binary(max_size=40)),
        st.tuples(st.just("append_many"), st.lists(st.binary(max_size=40), max_size=6)),
        st.tuples(st.just("reopen"), st.none()),
        st.tuples(st.just("truncate_before"), st.integers(0, 60)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_replay_matches_a_model_list(steps) -> None:
    model: list[bytes] = []  # model[offset] is the payload at that offset
    with tempfile.TemporaryDirectory() as directory:
        log = DurableLog(directory, segment_bytes=120, sync="never")
        try:
            for kind, argument in steps:
                if kind == "append":
                    assert log.append(argument) == len(model)
                    model.append(argument)
                elif kind == "append_many":
                    assert log.append_many(argument) == list(
                        range(len(model), len(model) + len(argument))
                    )
                    model.extend(argument)
                elif kind == "reopen":
                    log.close()
                    log = DurableLog(directory, segment_bytes=120, sync="never")
                else:
                    before = log.first_offset
                    log.truncate_before(argument)
                    # Nothing at or above `argument` is deleted, and deletions only move forward.
                    assert before <= log.first_offset <= max(before, min(argument, len(model)))
                assert log.next_offset == len(model)
                first = log.first_offset
                assert contents(log) == list(enumerate(model))[first:]
        finally:
            log.close()


CHILD = textwrap.dedent(
    """
    import sys
    from rollwire.services.buffer.durable_log import DurableLog

    log = DurableLog(sys.argv[1], segment_bytes=4096, sync="always")
    offset = 0
    while True:
        payload = (f"{offset}:" * (1 + offset % 50)).encode()
        offset = log.append(payload)
        print(offset, flush=True)
        offset += 1
    """
)


def expected_child_payload(offset: int) -> bytes:
    return (f"{offset}:" * (1 + offset % 50)).encode()


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_acknowledged_record_survives_a_kill(tmp_path, seed) -> None:
    kill_after = random.Random(seed).randint(20, 400)
    log_dir = tmp_path / "log"
    errors = (tmp_path / "child.stderr").open("w")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log_dir)],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    acknowledged: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [acknowledged.put(line) for line in child.stdout])
    reader.start()
    acked: list[int] = []
    try:
        while len(acked) < kill_after:
            try:
                line = acknowledged.get(timeout=30)
            except queue.Empty:
                pytest.fail(f"the child stopped acknowledging: {child.poll()=}")
            acked.append(int(line))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        reader.join(timeout=30)
        errors.close()
    while not acknowledged.empty():  # acknowledged after we decided to kill, before it died
        acked.append(int(acknowledged.get_nowait()))
    assert acked == list(range(len(acked)))
    with DurableLog(log_dir, segment_bytes=4096) as log:
        records = dict(log.replay())
        assert log.next_offset >= len(acked)
    for offset in acked:
        assert records[offset] == expected_child_payload(offset)
    assert all(records[o] == expected_child_payload(o) for o in records)
