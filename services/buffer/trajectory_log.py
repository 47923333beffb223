"""The buffer's durable record: accepted trajectories and what became of them, on a
`rollwire.services.buffer.durable_log.DurableLog`, and how a buffer rebuilds from it."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollwire.services.buffer.durable_log import DurableLog
from rollwire.services.buffer.ledger import OrdinalLedger
from rollwire.services.core.wire import TrajectoryFrame, peek

if TYPE_CHECKING:
    from rollwire.services.buffer.state import BufferState

log = logging.getLogger(__name__)


class TrajectoryLog:
    """The buffer's durable record: accepted trajectories and what became of them.

    Records are a kind byte and a body: b"T" + a trajectory frame; b"C" + JSON
    {ids, ordinals, outcome} for groups that left for good (older logs wrote a bare
    list of ids); b"P" + {ids} trained but not yet checkpointed; b"R" + {ids} back
    to ready; b"L" + a snapshot of the ordinal ledger, written before segments are
    deleted, so what the deleted records said about ordinals is not forgotten.
    Segments are deleted once every trajectory in them has been consumed.
    """

    def __init__(self, directory: Path, sync: str = "batch", segment_bytes: int = 64 * 2**20):
        self.log = DurableLog(directory, segment_bytes=segment_bytes, sync=sync)
        self._live: OrderedDict[str, int] = OrderedDict()  # id -> offset, in log order
        self._dirty = False

    def restore(self, state: BufferState, max_frame_bytes: int) -> int:
        """Rebuilds `state` from the log; returns the number of trajectories back in it."""
        trajectories: list[tuple[int, TrajectoryFrame]] = []
        consumed: set[str] = set()
        pending: set[str] = set()
        for offset, record in self.log.replay():
            kind, body = record[:1], record[1:]
            if kind == b"T":
                trajectories.append((offset, peek(body, max_frame_bytes)))
                continue
            if kind not in (b"C", b"P", b"R", b"L"):
                raise ValueError(f"buffer log record {offset} has unknown kind {kind!r}")
            data = json.loads(body)
            if kind == b"L":
                state.ledger = OrdinalLedger.from_snapshot(data)
            elif kind == b"C":
                if isinstance(data, list):  # the first format: ids only
                    data = {"ids": data, "ordinals": [], "outcome": "trained"}
                consumed.update(data["ids"])
                pending.difference_update(data["ids"])
                for ordinal in data["ordinals"]:
                    state.ledger.finish(int(ordinal), str(data["outcome"]))
            elif kind == b"P":
                pending.update(data["ids"])
            else:
                pending.difference_update(data["ids"])
        restored = 0
        for offset, trajectory in trajectories:
            if trajectory.trajectory_id in consumed:
                continue
            accepted, reason = state.put(trajectory)
            if reason == "ok":
                self._live[trajectory.trajectory_id] = offset
                restored += 1
            elif not accepted:
                log.warning("a logged trajectory was not taken back: %s", reason)
        # Groups trained before the restart wait for the trainer's checkpoint (or resume).
        held = state._pull(pending, (state.ready,))
        if held:
            state.trained["restored"] = held
        state.take_journal()  # replaying changed nothing on disk
        return restored

    def write(self, journal: list[tuple[bytes, dict[str, Any]]], ledger: OrdinalLedger) -> None:
        """Writes what the state journalled; consumed trajectories free their segments."""
        if not journal:
            return
        freed = False
        for kind, data in journal:
            self.log.append(kind + json.dumps(data).encode())
            if kind == b"C":
                freed = True
                for trajectory_id in data["ids"]:
                    self._live.pop(trajectory_id, None)
        self._dirty = True
        if not freed:
            return
        # Everything before the oldest live trajectory is consumed: those segments can go,
        # once a ledger snapshot (durable first) keeps what they said about ordinals.
        oldest = next(iter(self._live.values()), self.log.next_offset)
        starts = self.log.segment_offsets
        if len(starts) > 1 and starts[1] <= oldest:
            self.log.append(b"L" + json.dumps(ledger.snapshot()).encode())
            if self.log.sync != "never":
                self.log.flush()
            self.log.truncate_before(oldest)

    def append_trajectory(self, trajectory_id: str, frame: bytes) -> None:
        """Writes an accepted trajectory (reaches the kernel now; `flush` makes it durable)."""
        self.append_trajectories([(trajectory_id, frame)])

    def append_trajectories(self, trajectories: list[tuple[str, bytes]]) -> None:
        """Writes accepted trajectories, (id, frame) each, in one write: all or none."""
        offsets = self.log.write_many([(b"T", frame) for _, frame in trajectories])
        for (trajectory_id, _), offset in zip(trajectories, offsets, strict=True):
            self._live[trajectory_id] = offset
        self._dirty = True

    def flush(self) -> None:
        """Makes what was appended durable before acks go out, as the sync mode says: one
        fsync in "batch" mode; none in "always" (each append was) or "never" (the OS decides)."""
        if self._dirty and self.log.sync == "batch":
            self.log.flush()
        self._dirty = False

    def forget(self, trajectory_ids: set[str]) -> None:
        """Stops tracking trajectories whose ack was refused after a failed fsync. Their
        records may still be on disk: a restart takes them back, and the producer's
        resend is then a duplicate, so nothing is held twice."""
        for trajectory_id in trajectory_ids:
            self._live.pop(trajectory_id, None)

    @property
    def broken(self) -> str | None:
        """Why the log refuses writes until reopened (a failed fsync), or None."""
        return self.log.broken

    def reopen(self) -> None:
        """Closes the log and opens it again, which re-reads every segment from disk."""
        old = self.log
        old.close()
        self.log = DurableLog(old.directory, segment_bytes=old.segment_bytes, sync=old.sync)
        self._dirty = False

    def close(self) -> None:
        self.log.close()
