"""What the replay buffer holds, apart from its sockets: groups being assembled,
ready, served, trained; the ordinal ledger; the journal the trajectory log writes.

The buffer holds trajectories as their wire frames (`TrajectoryFrame`: the bytes
and the few fields read from them by `wire.peek`), never decoded: what it serves
is the bytes it was sent.

`BufferState` is plain data and methods, so it is unit-tested without ZeroMQ;
`rollwire.services.buffer.server` serves it, and
`rollwire.services.buffer.trajectory_log` writes its journal and rebuilds it.

Staleness: with trainer version v and bound k, a group any of whose generated
tokens is older than v - k is dropped (counted, reason "stale") instead of served.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from rollwire.services.buffer.ledger import OrdinalLedger
from rollwire.services.buffer.protocol import BufferStatus, LedgerView, ResumeAnswer
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.wire import Trajectory, TrajectoryFrame

Group: TypeAlias = list[TrajectoryFrame]


@dataclass
class FrameBatch:
    """Whole groups served to the trainer together, as the frames they came in."""

    batch_id: str
    trainer_version: int
    """The trainer's version when the batch was assembled."""
    trajectories: list[TrajectoryFrame]
    """Whole groups, in group order."""


@dataclass
class BufferState:
    """What the buffer holds, independent of sockets (unit-testable).

    A group moves ready -> served (unacked) -> trained (waiting for the trainer's
    next checkpoint) -> consumed. What happens is also written down in `journal`
    for the trajectory log: ("C", consumed for good, with the groups' ordinals and
    outcome), ("P", trained but not yet checkpointed), ("R", back to ready).
    """

    group_size: int
    max_staleness: int
    max_ready_groups: int = 10_000
    trainer_version: int = 0
    trainer_step: int = 0
    partial: dict[str, Group] = field(default_factory=dict)
    ready: deque[Group] = field(default_factory=deque)
    seen: set[str] = field(default_factory=set)
    unacked: OrderedDict[str, list[Group]] = field(default_factory=OrderedDict)
    trained: OrderedDict[str, list[Group]] = field(default_factory=OrderedDict)
    ledger: OrdinalLedger = field(default_factory=OrdinalLedger)
    accepted: int = 0
    served_trajectories: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    journal: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)
    shares: dict[str, int] = field(default_factory=dict)
    """Groups per batch by domain (or source, per `share_by`); empty: arrival order."""
    share_by: str = "domain"

    def _share_key(self, trajectory: TrajectoryFrame) -> str:
        return trajectory.domain if self.share_by == "domain" else trajectory.source

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        COUNTERS.inc("buffer_dropped", amount=count, reason=reason)

    def check(self, trajectory: TrajectoryFrame) -> tuple[bool, str]:
        """Whether `put` would take the trajectory, without changing anything."""
        if trajectory.trajectory_id in self.seen or self.ledger.finished(trajectory.prompt_ordinal):
            return True, "duplicate"
        if not 0 <= trajectory.sample_index < self.group_size:
            return (
                False,
                f"sample_index {trajectory.sample_index} outside a group of {self.group_size}",
            )
        if self.shares and self._share_key(trajectory) not in self.shares:
            return (
                False,
                f"{self.share_by} {self._share_key(trajectory)!r} has no share in "
                f"buffer.batch_shares {self.shares}",
            )
        if len(self.ready) >= self.max_ready_groups:
            return False, "full"
        group = self.partial.get(trajectory.group_id, ())
        if any(t.sample_index == trajectory.sample_index for t in group):
            return (
                False,
                f"group {trajectory.group_id!r} already has sample {trajectory.sample_index}",
            )
        if group and group[0].prompt_ordinal != trajectory.prompt_ordinal:
            return (
                False,
                f"group {trajectory.group_id!r} has prompt_ordinal {group[0].prompt_ordinal}, "
                f"not {trajectory.prompt_ordinal}",
            )
        return True, "ok"

    def put(self, trajectory: TrajectoryFrame | Trajectory) -> tuple[bool, str]:
        """Accepts a trajectory (a decoded one is encoded first); returns (accepted, reason)."""
        if isinstance(trajectory, Trajectory):
            trajectory = TrajectoryFrame.of(trajectory)
        accepted, reason = self.check(trajectory)
        if reason == "duplicate":
            COUNTERS.inc("buffer_duplicates")
        if reason != "ok":
            return accepted, reason
        self.add(trajectory)
        return True, "ok"

    def add(self, trajectory: TrajectoryFrame) -> None:
        """Holds a trajectory `check` has passed."""
        self.seen.add(trajectory.trajectory_id)
        self.ledger.saw(trajectory.prompt_ordinal)
        group = self.partial.setdefault(trajectory.group_id, [])
        group.append(trajectory)
        self.accepted += 1
        if len(group) == self.group_size:
            del self.partial[trajectory.group_id]
            self.ready.append(sorted(group, key=lambda t: t.sample_index))

    def forget(self, trajectory_ids: set[str]) -> None:
        """Undoes `add` for trajectories not yet served (a burst whose log write never
        became durable): their groups lose them, and a resend is taken afresh."""
        ready: deque[Group] = deque()
        for group in self.ready:
            if any(t.trajectory_id in trajectory_ids for t in group):
                self.partial[group[0].group_id] = list(group)  # filtered just below
            else:
                ready.append(group)
        self.ready = ready
        for group_id, group in list(self.partial.items()):
            kept = [t for t in group if t.trajectory_id not in trajectory_ids]
            if kept:
                self.partial[group_id] = kept
            else:
                del self.partial[group_id]
        gone = self.seen & trajectory_ids
        self.seen -= gone
        self.accepted -= len(gone)

    def take_journal(self) -> list[tuple[bytes, dict[str, Any]]]:
        """What changed since the last call, for the trajectory log."""
        journal, self.journal = self.journal, []
        return journal

    def _consume(self, groups: list[Group], outcome: str) -> None:
        """Groups that left the buffer for good: their ordinals are finished."""
        if not groups:
            return
        ids = [t.trajectory_id for group in groups for t in group]
        ordinals = [group[0].prompt_ordinal for group in groups]
        for ordinal in ordinals:
            self.ledger.finish(ordinal, outcome)
        self.seen.difference_update(ids)  # the ledger answers for them from now on
        self.journal.append((b"C", {"ids": ids, "ordinals": ordinals, "outcome": outcome}))

    def _stale(self, group: Group) -> bool:
        versions = [t.oldest_version for t in group if t.oldest_version is not None]
        return bool(versions) and min(versions) < self.trainer_version - self.max_staleness

    def take(self, groups: int) -> FrameBatch | None:
        """`groups` whole groups within the staleness bound (per `shares` when set), oldest
        first, or None if there are not enough yet."""
        if self.shares:
            chosen = self._take_shares()
        else:
            chosen = []
            while self.ready and len(chosen) < groups:
                group = self.ready.popleft()
                if self._stale(group):
                    self._drop("stale", len(group))
                    self._consume([group], "stale")
                    continue
                chosen.append(group)
            if len(chosen) < groups:
                for group in reversed(chosen):  # not enough yet: keep them for the next request
                    self.ready.appendleft(group)
                chosen = None
        if chosen is None:
            return None
        batch_id = uuid.uuid4().hex
        self.unacked[batch_id] = chosen
        self.served_trajectories += sum(len(g) for g in chosen)
        return FrameBatch(batch_id, self.trainer_version, [t for group in chosen for t in group])

    def _take_shares(self) -> list[Group] | None:
        """The oldest groups of each share key, as many as its share, or None (nothing
        taken) while a key has too few; stale groups met on the way are dropped."""
        wanted = dict(self.shares)
        picked: dict[str, list[Group]] = {key: [] for key in wanted}
        fresh: deque[Group] = deque()  # the ready queue without stale groups
        kept: deque[Group] = deque()  # and without the picked ones
        for group in self.ready:
            key = self._share_key(group[0])
            if self._stale(group):
                self._drop("stale", len(group))
                self._consume([group], "stale")
                continue
            fresh.append(group)
            if key not in picked:  # logged before the shares changed: never served
                kept.append(group)
            elif len(picked[key]) < wanted[key]:
                picked[key].append(group)
            else:
                kept.append(group)
        if any(len(picked[key]) < wanted[key] for key in wanted):
            self.ready = fresh  # not yet: all stay, in the order they came
            return None
        self.ready = kept
        return [group for key in wanted for group in picked[key]]

    def ack(
        self,
        batch_id: str,
        trajectory_ids: list[str] | None = None,
        commit: bool = True,
        bad_ids: list[str] | None = None,
    ) -> bool:
        """Marks a served batch trained: consumed (`commit`), or held until the trainer's
        next checkpoint commits it. A batch this buffer does not know (served before a
        restart, requeued since) is found by its trajectory ids instead, so nothing the
        trainer has trained on is served again. Groups holding one of `bad_ids` (frames
        the trainer could not decode) were not trained: they are let go at once, counted
        as dropped "bad_frame"."""
        groups = self.unacked.pop(batch_id, None)
        if groups is None:
            wanted = set(trajectory_ids or ()) | set(bad_ids or ())
            groups = self._pull(wanted, (self.ready, self.unacked))
            if not groups:
                return False
        if bad_ids:
            bad = set(bad_ids)
            broken = [g for g in groups if any(t.trajectory_id in bad for t in g)]
            groups = [g for g in groups if not any(g is b for b in broken)]
            self._drop("bad_frame", sum(len(g) for g in broken))
            self._consume(broken, "bad_frame")
        if commit:
            self._consume(groups, "trained")
        elif groups:
            self.trained[batch_id] = groups
            ids = [t.trajectory_id for group in groups for t in group]
            self.journal.append((b"P", {"ids": ids}))
        return True

    def commit(self, trajectory_ids: list[str]) -> int:
        """The trainer checkpointed these: consumed for good. Returns how many groups."""
        groups = self._pull(set(trajectory_ids), (self.trained, self.unacked, self.ready))
        self._consume(groups, "trained")
        return len(groups)

    def resume(self, committed_ids: list[str]) -> ResumeAnswer:
        """A trainer restarted from a checkpoint that holds `committed_ids` (trained since
        the checkpoint before it): those are consumed; everything served or trained after
        it goes back to the front of the queue, to be trained again."""
        committed = self.commit(committed_ids)
        requeued = 0
        back: list[Group] = []
        for groups in list(self.unacked.values()) + list(self.trained.values()):
            back.extend(groups)
        pending = [t.trajectory_id for groups in self.trained.values() for g in groups for t in g]
        if pending:
            self.journal.append((b"R", {"ids": pending}))
        self.unacked.clear()
        self.trained.clear()
        for group in reversed(back):
            self.ready.appendleft(group)
            requeued += 1
        return ResumeAnswer(committed, requeued, self.trainer_version)

    def drop_ordinal(self, ordinal: int, group_id: str, outcome: str) -> bool:
        """The producer gave up on a prompt ("filtered", "failed"): its ordinal is finished
        and whatever part of its group arrived is let go. False if it had already ended."""
        part = self.partial.pop(group_id, [])
        ids = [t.trajectory_id for t in part]
        self.seen.difference_update(ids)
        if not self.ledger.finish(ordinal, outcome):
            return False
        self.journal.append((b"C", {"ids": ids, "ordinals": [ordinal], "outcome": outcome}))
        return True

    def _pull(self, ids: set[str], places: tuple[deque | OrderedDict, ...]) -> list[Group]:
        """Removes and returns the groups in `places` holding any of `ids`."""
        found: list[Group] = []
        if not ids:
            return found
        for place in places:
            if isinstance(place, deque):
                kept: deque[Group] = deque()
                for group in place:
                    (found if any(t.trajectory_id in ids for t in group) else kept).append(group)
                place.clear()
                place.extend(kept)
                continue
            for key, groups in list(place.items()):
                hit = [g for g in groups if any(t.trajectory_id in ids for t in g)]
                if hit:
                    found.extend(hit)
                    rest = [g for g in groups if g not in hit]
                    if rest:
                        place[key] = rest
                    else:
                        del place[key]
        return found

    def requeue_unacked(self) -> None:
        """Served batches never acknowledged go back to the front of the queue (on restart)."""
        for groups in reversed(list(self.unacked.values())):
            for group in reversed(groups):
                self.ready.appendleft(group)
        self.unacked.clear()

    def ledger_view(self) -> LedgerView:
        """The ordinal ledger and the ordinals of the groups held now, whole or in part:
        what a restarted producer resumes from."""
        whole = [g[0].prompt_ordinal for g in self.ready]
        for place in (self.unacked, self.trained):
            whole.extend(g[0].prompt_ordinal for groups in place.values() for g in groups)
        partial = {
            str(group[0].prompt_ordinal): sorted(t.sample_index for t in group)
            for group in self.partial.values()
        }
        return LedgerView(**self.ledger.snapshot(), whole=sorted(whole), partial=partial)

    def status(self) -> BufferStatus:
        """What the buffer holds and has done, as the status request answers it."""
        return BufferStatus(
            trainer_version=self.trainer_version,
            trainer_step=self.trainer_step,
            accepted=self.accepted,
            ready_groups=len(self.ready),
            partial_groups=len(self.partial),
            served_trajectories=self.served_trajectories,
            unacked_batches=len(self.unacked),
            trained_uncommitted_batches=len(self.trained),
            dropped=dict(self.dropped),
            outcomes=dict(self.ledger.outcomes),
            frontier=self.ledger.frontier,
        )
