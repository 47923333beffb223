"""A durable append-only log of byte records: what the replay buffer writes before it acknowledges.

Layout: one directory holding `segment-<first offset, 20 digits>.log` files and a
`LOCK` file. A record is a 16-byte header followed by its payload:

    magic b"RWL1" | payload length (u32 LE) | CRC32 of payload (u32) | CRC32 of the 12 bytes before (u32)

The header has its own CRC so that a damaged length is recognised as damage, not
read as "the file ends early". A record's offset is its index in the whole log:
the segment's first offset (from its name) plus its position in the segment.
Offsets only grow, across restarts and deletions of old segments.

Durability by `sync` mode (`flush()` fsyncs in every mode; it is how a caller
asks for durability explicitly; `close()` fsyncs unless the mode is "never"):

"always"
    `append` and `append_many` return only after the records are written and the
    segment file is fsynced; a segment created on the way is fsynced together with
    its directory entry (the directory is fsynced). A returned offset survives a
    process kill, an OS crash and a power loss. `append_many` costs one write and
    one fsync for the whole list: the buffer groups a burst of puts this way.
"batch"
    `append` returns once the record has reached the kernel (one write, no fsync):
    it survives a kill of this process but not an OS crash. `append_many` and
    `flush` fsync before returning, which makes that call's records and every
    earlier one durable. Pattern: `append` each item of a burst, `flush()` once,
    then acknowledge them all. On a roll-over the old segment is fsynced and the
    new one's directory entry too, so unsynced data only ever sits in the last segment.
"never"
    The log never fsyncs on its own (only an explicit `flush()` does). Records
    survive a kill of this process (they are written with os.write, no user-space
    buffer) but an OS crash may lose any of them, or leave damage that recovery
    refuses to guess about. For tests, benchmarks and throwaway runs.

Recovery on open: every segment is read and checked. A damaged tail of the last
segment (a short header, a short payload, a CRC mismatch, with no valid record
after it) is what a crash in the middle of a write leaves: it is truncated away,
logged and counted (`durable_log_torn_tails`). Damage anywhere else — an earlier
segment, or a bad record with a good one after it — and a gap between segments
raise `LogCorrupted` naming the file and byte position: the operator decides.

One process at a time: the directory is locked with flock on open; a second
`DurableLog` on it (in any process) gets `LogLocked`. Methods may be called from
several threads; a replay reads a snapshot of the log as it was when called.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rollwire.services.core.config.names import LogSync
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)

MAGIC = b"RWL1"
_HEAD = struct.Struct("<4sII")  # magic, payload length, payload CRC
_HEAD_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
MAX_PAYLOAD_BYTES = 2**32 - 1
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16
_SEGMENT_NAME = re.compile(r"segment-(\d{20})\.log")
LOCK_NAME = "LOCK"

SyncMode = LogSync


class LogError(Exception):
    """Base class of everything the durable log raises on purpose."""


class LogCorrupted(LogError):
    """The log on disk is damaged where a crash cannot have damaged it; nothing was changed."""

    def __init__(self, path: Path, position: int, problem: str) -> None:
        super().__init__(f"{path} at byte {position}: {problem}")
        self.path = path
        self.position = position
        self.problem = problem


class LogWriteError(LogError):
    """An append (or opening for appends) failed; no record of that call is in the log."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class LogLocked(LogError):
    """Another DurableLog (in this or another process) holds the directory."""


class OffsetOutOfRange(LogError):
    """A replay was asked for an offset the log no longer (or does not yet) hold."""


@dataclass
class _Segment:
    first_offset: int
    path: Path
    records: int
    size: int


def segment_name(first_offset: int) -> str:
    """The file name of the segment whose first record has this offset."""
    return f"segment-{first_offset:020d}.log"


Payload = bytes | memoryview | tuple[bytes | memoryview, ...]
"""A record's payload: bytes, or pieces written one after the other as one payload (a
type byte and a frame held elsewhere, say), so that nothing is joined to be written."""


def _record_parts(payload: Payload) -> list[bytes | memoryview]:
    """The record's header, then its payload's pieces, as they go to a segment."""
    pieces = payload if isinstance(payload, tuple) else (payload,)
    length, crc = 0, 0
    for piece in pieces:
        length += len(piece)
        crc = zlib.crc32(piece, crc)
    if length > MAX_PAYLOAD_BYTES:
        raise ValueError(f"a record holds at most {MAX_PAYLOAD_BYTES} bytes, got {length}")
    head = _HEAD.pack(MAGIC, length, crc)
    return [head + _HEAD_CRC.pack(zlib.crc32(head)), *pieces]


def encode_record(payload: Payload) -> bytes:
    """Header + payload, as written to a segment."""
    return b"".join(_record_parts(payload))


def _read_record(data: memoryview, position: int) -> tuple[int, str | None]:
    """(end of the record at `position`, None) if it is intact, else (position, what is wrong)."""
    available = len(data) - position
    if available < HEADER_BYTES:
        return position, f"short header ({available} of {HEADER_BYTES} bytes)"
    magic, length, payload_crc = _HEAD.unpack_from(data, position)
    (head_crc,) = _HEAD_CRC.unpack_from(data, position + _HEAD.size)
    if magic != MAGIC:
        return position, f"bad magic {bytes(magic)!r}"
    if zlib.crc32(data[position : position + _HEAD.size]) != head_crc:
        return position, "header CRC mismatch"
    end = position + HEADER_BYTES + length
    if end > len(data):
        return position, f"short payload ({available - HEADER_BYTES} of {length} bytes)"
    if zlib.crc32(data[position + HEADER_BYTES : end]) != payload_crc:
        return position, "payload CRC mismatch"
    return end, None


def _valid_record_after(data: memoryview, position: int) -> int | None:
    """The position of the first intact record starting after `position`, if any."""
    raw = data.obj if isinstance(data.obj, bytes | mmap.mmap) else bytes(data)
    search = position + 1
    while (found := raw.find(MAGIC, search, len(data))) != -1:
        if _read_record(data, found)[1] is None:
            return found
        search = found + 1
    return None


def _map(path: Path, size: int) -> mmap.mmap | None:
    if size == 0:
        return None
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)


def _describe(error: OSError) -> str:
    name = errno.errorcode.get(error.errno or 0, "")
    return f"{name}: {os.strerror(error.errno)}" if error.errno else str(error)


class DurableLog:
    """An append-only, crash-safe log of byte records addressed by offset. See the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        segment_bytes: int = 64 * 1024 * 1024,
        sync: SyncMode = "batch",
    ) -> None:
        if sync not in ("always", "batch", "never"):
            raise ValueError(f"sync must be 'always', 'batch' or 'never', not {sync!r}")
        if segment_bytes < HEADER_BYTES:
            raise ValueError(f"segment_bytes must be at least {HEADER_BYTES}")
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.sync = sync
        self._mutex = threading.RLock()
        self._segments: list[_Segment] = []
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._broken: str | None = None
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = self._lock()
            self._recover()
            if not self._segments:
                self._segments.append(self._create_segment(0))
            self._fd = self._open_active()
        except OSError as error:
            self._release()
            raise LogWriteError(
                f"durable log {self.directory}: cannot open for appending: {_describe(error)}",
                error.errno,
            ) from error
        except BaseException:
            self._release()
            raise

    # -- properties ---------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why writes are refused until the log is reopened (a failed fsync), or None."""
        return self._broken

    @property
    def next_offset(self) -> int:
        """The offset the next appended record will get."""
        with self._mutex:
            active = self._segments[-1]
            return active.first_offset + active.records

    @property
    def first_offset(self) -> int:
        """The oldest offset still held (everything below was removed by truncate_before)."""
        with self._mutex:
            return self._segments[0].first_offset

    @property
    def segment_offsets(self) -> list[int]:
        """The first offset of each segment, oldest first."""
        with self._mutex:
            return [segment.first_offset for segment in self._segments]

    @property
    def segments(self) -> list[Path]:
        """The segment files, oldest first; the last one is the one being written."""
        with self._mutex:
            return [segment.path for segment in self._segments]

    # -- writing ------------------------------------------------------------------

    def append(self, payload: Payload) -> int:
        """Appends one record; returns its offset. Durable on return as the sync mode says."""
        return self.write_many([payload])[0]

    def append_many(self, payloads: Iterable[Payload]) -> list[int]:
        """Appends records with one write (and, unless sync="never", one fsync); returns their offsets.

        All or nothing: if it raises, none of these records is in the log.
        """
        return self._append(list(payloads), fsync=self.sync != "never")

    def write_many(self, payloads: Iterable[Payload]) -> list[int]:
        """Appends records with one write, durable on return as `append`'s are (an fsync
        only with sync="always"); returns their offsets. All or nothing, as `append_many`."""
        return self._append(list(payloads), fsync=self.sync == "always")

    def flush(self) -> None:
        """Makes every record appended so far durable (fsync), whatever the sync mode."""
        with self._mutex:
            self._check_writable()
            self._fsync_active()

    def _append(self, payloads: list[Payload], fsync: bool) -> list[int]:
        pieces = [piece for payload in payloads for piece in _record_parts(payload)]
        size = sum(len(piece) for piece in pieces)
        with self._mutex:
            self._check_writable()
            if not payloads:
                return []
            active = self._segments[-1]
            if active.size > 0 and active.size + size > self.segment_bytes:
                active = self._roll()
            self._write(active, pieces, size)
            first = active.first_offset + active.records
            active.records += len(payloads)
            active.size += size
            if fsync:
                self._fsync_active()
            return list(range(first, first + len(payloads)))

    def _write(self, active: _Segment, pieces: list[bytes | memoryview], size: int) -> None:
        """Writes all of `pieces` (`size` bytes) at the end of the active segment, one
        gathered write as far as the system takes it (no joined copy), or nothing."""
        assert self._fd is not None
        views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
        start = 0
        try:
            while start < len(views):
                written = os.writev(self._fd, views[start : start + _IOV_MAX])
                while start < len(views) and written >= len(views[start]):  # what went
                    written -= len(views[start])
                    start += 1
                if written:  # resume in the middle of a piece
                    views[start] = views[start][written:]
        except OSError as error:
            self._undo_partial_write(active, error)
            raise LogWriteError(
                f"durable log {self.directory}: writing {size} bytes to "
                f"{active.path.name} failed: {_describe(error)}",
                error.errno,
            ) from error

    def _undo_partial_write(self, active: _Segment, error: OSError) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, active.size)
        except OSError as second:
            self._broken = (
                f"a failed write ({_describe(error)}) could not be undone ({_describe(second)}); "
                "reopen the log to recover"
            )

    def _fsync_active(self) -> None:
        assert self._fd is not None
        try:
            os.fsync(self._fd)
        except OSError as error:
            # After a failed fsync the kernel may have dropped the dirty pages while
            # still showing them to reads, and a second fsync may succeed without
            # writing them: nothing in memory can be trusted until a reopen rescans.
            self._broken = f"fsync failed ({_describe(error)}); reopen the log to recover"
            raise LogWriteError(
                f"durable log {self.directory}: fsync of {self._segments[-1].path.name} "
                f"failed: {_describe(error)}",
                error.errno,
            ) from error

    def _roll(self) -> _Segment:
        """Starts a new segment at next_offset; returns it."""
        if self.sync != "never":
            self._fsync_active()
        segment = None
        try:
            segment = self._create_segment(self.next_offset)
            fd = self._open_active(segment)
        except OSError as error:
            if segment is not None:  # it would overlap the records still going to the old one
                segment.path.unlink(missing_ok=True)
            raise LogWriteError(
                f"durable log {self.directory}: cannot start segment "
                f"{segment_name(self.next_offset)}: {_describe(error)}",
                error.errno,
            ) from error
        assert self._fd is not None
        os.close(self._fd)
        self._fd = fd
        self._segments.append(segment)
        return segment

    def _create_segment(self, first_offset: int) -> _Segment:
        path = self.directory / segment_name(first_offset)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        if self.sync != "never":
            try:
                self._fsync_directory()
            except OSError:
                path.unlink(missing_ok=True)  # an entry that may not survive must not linger
                raise
        return _Segment(first_offset, path, 0, 0)

    def _open_active(self, segment: _Segment | None = None) -> int:
        segment = segment or self._segments[-1]
        return os.open(segment.path, os.O_WRONLY | os.O_APPEND)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _check_writable(self) -> None:
        if self._closed:
            raise LogError(f"durable log {self.directory} is closed")
        if self._broken is not None:
            raise LogWriteError(f"durable log {self.directory}: {self._broken}")

    # -- removing old segments -------------------------------------------------------

    def truncate_before(self, offset: int) -> int:
        """Deletes the segments whose records all lie below `offset`; returns how many.

        The segment being written is never deleted, so `first_offset` may stay below
        `offset`. Oldest first, so a crash midway leaves a log without gaps.
        """
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        deleted = 0
        with self._mutex:
            self._check_writable()
            while len(self._segments) > 1 and self._segments[1].first_offset <= offset:
                try:
                    self._segments[0].path.unlink()
                    if self.sync != "never":
                        self._fsync_directory()
                except OSError as error:
                    raise LogWriteError(
                        f"durable log {self.directory}: cannot delete "
                        f"{self._segments[0].path.name}: {_describe(error)}",
                        error.errno,
                    ) from error
                del self._segments[0]
                deleted += 1
        return deleted

    # -- reading ------------------------------------------------------------------

    def replay(self, start_offset: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yields (offset, payload) from `start_offset` (default: first_offset) to the current end.

        Records appended after this call are not included. Raises OffsetOutOfRange
        now if `start_offset` was deleted or lies past next_offset, and LogCorrupted
        while iterating if a record changed on disk since it was written.
        """
        with self._mutex:
            if self._closed:
                raise LogError(f"durable log {self.directory} is closed")
            start = self.first_offset if start_offset is None else start_offset
            if not self.first_offset <= start <= self.next_offset:
                raise OffsetOutOfRange(
                    f"durable log {self.directory}: offset {start} is outside "
                    f"[{self.first_offset}, {self.next_offset}] (older segments were deleted "
                    "by truncate_before)"
                    if start < self.first_offset
                    else f"durable log {self.directory}: offset {start} is past the end "
                    f"({self.next_offset})"
                )
            snapshot = [
                _Segment(s.first_offset, s.path, s.records, s.size)
                for s in self._segments
                if s.first_offset + s.records > start
            ]
        return self._replay(snapshot, start)

    @staticmethod
    def _replay(segments: list[_Segment], start: int) -> Iterator[tuple[int, bytes]]:
        for segment in segments:
            try:
                mapped = _map(segment.path, segment.size)
            except FileNotFoundError as error:
                raise OffsetOutOfRange(f"{segment.path} was deleted during the replay") from error
            if mapped is None:
                continue
            with mapped:
                data = memoryview(mapped)
                try:
                    position = 0
                    for index in range(segment.records):
                        end, problem = _read_record(data, position)
                        if problem is not None:
                            raise LogCorrupted(
                                segment.path, position, f"{problem} (changed on disk)"
                            )
                        offset = segment.first_offset + index
                        if offset >= start:
                            yield offset, bytes(data[position + HEADER_BYTES : end])
                        position = end
                finally:
                    data.release()

    # -- opening and closing -------------------------------------------------------

    def _lock(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogLocked(
                f"durable log {self.directory} is in use by another writer (pid {holder}); "
                "two buffers cannot share one log"
            ) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _recover(self) -> None:
        found = sorted(
            (int(match.group(1)), self.directory / name)
            for name in os.listdir(self.directory)
            if (match := _SEGMENT_NAME.fullmatch(name))
        )
        for index, (first_offset, path) in enumerate(found):
            last = index == len(found) - 1
            segment = self._scan(first_offset, path, last)
            if self._segments:
                previous = self._segments[-1]
                expected = previous.first_offset + previous.records
                if first_offset != expected:
                    raise LogCorrupted(
                        path,
                        0,
                        f"starts at offset {first_offset} but {previous.path.name} ends at "
                        f"offset {expected} (a segment is missing or overlaps)",
                    )
            self._segments.append(segment)

    def _scan(self, first_offset: int, path: Path, last: bool) -> _Segment:
        size = path.stat().st_size
        mapped = _map(path, size)
        records, position, problem = 0, 0, None
        if mapped is not None:
            with mapped:
                data = memoryview(mapped)
                try:
                    while position < size:
                        end, problem = _read_record(data, position)
                        if problem is not None:
                            break
                        records += 1
                        position = end
                    if problem is not None:
                        later = _valid_record_after(data, position)
                        if not last or later is not None:
                            where = "" if last else " (not the last segment)"
                            after = f"; an intact record follows at byte {later}" if later else ""
                            raise LogCorrupted(
                                path,
                                position,
                                f"{problem} in record {first_offset + records}{where}{after}",
                            )
                finally:
                    data.release()
        if problem is not None:
            log.warning(
                "durable log: dropping a torn record at the end of %s (byte %d, %s, %d bytes)",
                path,
                position,
                problem,
                size - position,
            )
            COUNTERS.inc("durable_log_torn_tails")
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, position)
                if self.sync != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
        return _Segment(first_offset, path, records, position)

    def close(self) -> None:
        """Fsyncs (unless sync="never") and releases the directory; safe to call twice."""
        with self._mutex:
            if self._closed:
                return
            try:
                if self.sync != "never" and self._broken is None and self._fd is not None:
                    self._fsync_active()
            finally:
                self._closed = True
                self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    def __enter__(self) -> DurableLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DurableLog({str(self.directory)!r}, sync={self.sync!r}, "
            f"offsets=[{self.first_offset}, {self.next_offset}))"
        )
