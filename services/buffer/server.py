"""The replay buffer: trajectories in from producers, whole groups out to the trainer.

Two ZeroMQ ROUTER sockets, so every message has an explicit answer:

producer socket (orchestrators connect DEALERs)
    [b"put", seq, frame]   -> [b"ack", seq, {"accepted", "reason", "trainer_version", ...}]
    [b"put_group", seq, frame, ...]
                           -> [b"ack", seq, {"results": [{"accepted", "reason"}, ...],
                                             "trainer_version"}]
    [b"drop", seq, {"ordinal", "group_id", "outcome"}]
                           -> [b"ack", seq, {...}]  (the producer gave up on a prompt)
    [b"ledger"]            -> [b"ledger", {"frontier", "above", "highest", "outcomes",
                                           "whole", "partial"}]  (see services.ledger)
    [b"status"]            -> [b"status", {...}]
trainer socket (the trainer connects a DEALER)
    [b"get", {"trainer_version", "trainer_step", "groups", "wait_ms"}]
                           -> [b"batch", frame]   (a wire Batch of whole groups)
                           or [b"empty", {...}]   (nothing within the staleness bound by wait_ms)
    [b"ack", {"batch_id", "trainer_version", "trajectory_ids"?, "commit"?}]
                           -> [b"acked", {...}]   (trained; consumed unless commit is false,
                                                   when it waits for the trainer's checkpoint)
    [b"commit", {"trajectory_ids"}]
                           -> [b"committed", {...}]  (a checkpoint now holds these)
    [b"resume", {"committed_ids", "trainer_version", "trainer_step"}]
                           -> [b"resumed", {...}]  (a trainer restarted from its checkpoint:
                                                    what it trained after it is served again)
    [b"status"]            -> [b"status", {...}]

JSON bodies are UTF-8; `seq` is the producer's 8-byte sequence number, echoed.
A put is acknowledged once the trajectory is held in memory and written to the
buffer's log (`rollwire.services.buffer.durable_log`; a burst of puts shares one
fsync before their acks go out). Producers retry a put that was not
acknowledged with the same trajectory id; the buffer answers a duplicate with
accepted=true and keeps one copy. Anything malformed gets an answer that says
what was wrong, a counter, and the buffer keeps serving. When the log cannot be
written (disk full, directory gone) puts are refused with a reason starting
"storage:", which producers treat like "full": they wait and retry, they do not
drop.

Durability: the log holds every accepted trajectory and, as they happen, what
became of it: trained but not yet in a trainer checkpoint, consumed for good
(checkpointed, or dropped as stale), or given up by the producer. A buffer
started on an existing log rebuilds what it held: every trajectory not yet
consumed is back (a batch served but never acknowledged is served again; one
trained but not checkpointed waits for the trainer's commit or resume), and a
finished prompt ordinal still counts as seen. Segments holding only consumed
trajectories are deleted, after a snapshot of the ordinal ledger is written.

Security: with `buffer.curve` set, both sockets are ZeroMQ CURVE servers and only
clients whose public key is allowed complete the handshake (`rollwire.services.core.curve`);
a refused client's messages never arrive here, and the refusal is counted.

Staleness: with trainer version v and bound k, a group any of whose generated
tokens is older than v - k is dropped (counted, reason "stale") instead of served.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from rollwire.services.buffer.durable_log import LogError, LogWriteError
from rollwire.services.buffer.ledger import OrdinalLedger
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from rollwire.services.core.curve import DENIED_COUNTER, ZapHandler, secure_server, server_keys
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.wire import Batch, Trajectory, WireError, decode_trajectory, encode

if TYPE_CHECKING:
    from rollwire.services.core.config.models import CurveServerConfig

log = logging.getLogger(__name__)

_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def _ids(value: Any) -> list[str]:
    return [str(i) for i in value] if isinstance(value, list) else []


def oldest_version(trajectory: Trajectory) -> int | None:
    """The oldest policy version among the generated tokens; None if nothing was generated."""
    generated = trajectory.policy_versions[trajectory.loss_mask == 1]
    return int(generated.min()) if generated.size else None


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
    partial: dict[str, list[Trajectory]] = field(default_factory=dict)
    ready: deque[list[Trajectory]] = field(default_factory=deque)
    seen: set[str] = field(default_factory=set)
    unacked: OrderedDict[str, list[list[Trajectory]]] = field(default_factory=OrderedDict)
    trained: OrderedDict[str, list[list[Trajectory]]] = field(default_factory=OrderedDict)
    ledger: OrdinalLedger = field(default_factory=OrdinalLedger)
    accepted: int = 0
    served_trajectories: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    journal: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)
    shares: dict[str, int] = field(default_factory=dict)
    """Groups per batch by domain (or source, per `share_by`); empty: arrival order."""
    share_by: str = "domain"

    def _share_key(self, trajectory: Trajectory) -> str:
        return trajectory.domain if self.share_by == "domain" else trajectory.source

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        COUNTERS.inc("buffer_dropped", amount=count, reason=reason)

    def check(self, trajectory: Trajectory) -> tuple[bool, str]:
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

    def put(self, trajectory: Trajectory) -> tuple[bool, str]:
        """Accepts a trajectory; returns (accepted, reason)."""
        accepted, reason = self.check(trajectory)
        if reason == "duplicate":
            COUNTERS.inc("buffer_duplicates")
        if reason != "ok":
            return accepted, reason
        self.add(trajectory)
        return True, "ok"

    def add(self, trajectory: Trajectory) -> None:
        """Holds a trajectory `check` has passed."""
        self.seen.add(trajectory.trajectory_id)
        self.ledger.saw(trajectory.prompt_ordinal)
        group = self.partial.setdefault(trajectory.group_id, [])
        group.append(trajectory)
        self.accepted += 1
        if len(group) == self.group_size:
            del self.partial[trajectory.group_id]
            self.ready.append(sorted(group, key=lambda t: t.sample_index))

    def take_journal(self) -> list[tuple[bytes, dict[str, Any]]]:
        """What changed since the last call, for the trajectory log."""
        journal, self.journal = self.journal, []
        return journal

    def _consume(self, groups: list[list[Trajectory]], outcome: str) -> None:
        """Groups that left the buffer for good: their ordinals are finished."""
        if not groups:
            return
        ids = [t.trajectory_id for group in groups for t in group]
        ordinals = [group[0].prompt_ordinal for group in groups]
        for ordinal in ordinals:
            self.ledger.finish(ordinal, outcome)
        self.seen.difference_update(ids)  # the ledger answers for them from now on
        self.journal.append((b"C", {"ids": ids, "ordinals": ordinals, "outcome": outcome}))

    def _stale(self, group: list[Trajectory]) -> bool:
        versions = [v for v in (oldest_version(t) for t in group) if v is not None]
        return bool(versions) and min(versions) < self.trainer_version - self.max_staleness

    def take(self, groups: int) -> Batch | None:
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
        return Batch(batch_id, self.trainer_version, [t for group in chosen for t in group])

    def _take_shares(self) -> list[list[Trajectory]] | None:
        """The oldest groups of each share key, as many as its share, or None (nothing
        taken) while a key has too few; stale groups met on the way are dropped."""
        wanted = dict(self.shares)
        picked: dict[str, list[list[Trajectory]]] = {key: [] for key in wanted}
        fresh: deque[list[Trajectory]] = deque()  # the ready queue without stale groups
        kept: deque[list[Trajectory]] = deque()  # and without the picked ones
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
        self, batch_id: str, trajectory_ids: list[str] | None = None, commit: bool = True
    ) -> bool:
        """Marks a served batch trained: consumed (`commit`), or held until the trainer's
        next checkpoint commits it. A batch this buffer does not know (served before a
        restart, requeued since) is found by its trajectory ids instead, so nothing the
        trainer has trained on is served again."""
        groups = self.unacked.pop(batch_id, None)
        if groups is None:
            groups = self._pull(set(trajectory_ids or ()), (self.ready, self.unacked))
            if not groups:
                return False
        if commit:
            self._consume(groups, "trained")
        else:
            self.trained[batch_id] = groups
            ids = [t.trajectory_id for group in groups for t in group]
            self.journal.append((b"P", {"ids": ids}))
        return True

    def commit(self, trajectory_ids: list[str]) -> int:
        """The trainer checkpointed these: consumed for good. Returns how many groups."""
        groups = self._pull(set(trajectory_ids), (self.trained, self.unacked, self.ready))
        self._consume(groups, "trained")
        return len(groups)

    def resume(self, committed_ids: list[str]) -> dict[str, int]:
        """A trainer restarted from a checkpoint that holds `committed_ids` (trained since
        the checkpoint before it): those are consumed; everything served or trained after
        it goes back to the front of the queue, to be trained again."""
        committed = self.commit(committed_ids)
        requeued = 0
        back: list[list[Trajectory]] = []
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
        return {"committed_groups": committed, "requeued_groups": requeued}

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

    def _pull(
        self, ids: set[str], places: tuple[deque | OrderedDict, ...]
    ) -> list[list[Trajectory]]:
        """Removes and returns the groups in `places` holding any of `ids`."""
        found: list[list[Trajectory]] = []
        if not ids:
            return found
        for place in places:
            if isinstance(place, deque):
                kept: deque[list[Trajectory]] = deque()
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

    def held_ordinals(self) -> dict[str, Any]:
        """The ordinals of the groups held now, whole or in part (for a restarted producer)."""
        whole = [g[0].prompt_ordinal for g in self.ready]
        for place in (self.unacked, self.trained):
            whole.extend(g[0].prompt_ordinal for groups in place.values() for g in groups)
        partial = {
            str(group[0].prompt_ordinal): sorted(t.sample_index for t in group)
            for group in self.partial.values()
        }
        return {"whole": sorted(whole), "partial": partial}

    def status(self) -> dict[str, Any]:
        return {
            "trainer_version": self.trainer_version,
            "trainer_step": self.trainer_step,
            "accepted": self.accepted,
            "ready_groups": len(self.ready),
            "partial_groups": len(self.partial),
            "served_trajectories": self.served_trajectories,
            "unacked_batches": len(self.unacked),
            "trained_uncommitted_batches": len(self.trained),
            "dropped": dict(self.dropped),
            "outcomes": dict(self.ledger.outcomes),
            "frontier": self.ledger.frontier,
        }


@dataclass
class _WaitingGet:
    identity: bytes
    groups: int
    deadline: float


class BufferServer:
    """Serves a BufferState on two ROUTER sockets until stopped."""

    def __init__(
        self,
        state: BufferState,
        host: str = "127.0.0.1",
        producer_port: int = 0,
        trainer_port: int = 0,
        max_frame_bytes: int = 256 * 1024 * 1024,
        curve: CurveServerConfig | None = None,
        trajectory_log: TrajectoryLog | None = None,
    ) -> None:
        """With `curve`, both sockets are CURVE servers behind its client allow-list.

        Raises:
            OSError: a port cannot be bound.
            rollwire.services.core.curve.CurveError: a CURVE key or key file is unusable.
        """
        self.state = state
        self.max_frame_bytes = max_frame_bytes
        self.trajectory_log = trajectory_log
        self._zap = None
        self._curve_keys = None
        self._monitors: dict[zmq.Socket, str] = {}
        self._handshake_failure_logged = False
        if curve is None:
            self.context = zmq.Context.instance()
        else:
            self._curve_keys = server_keys(curve)
            # A context of its own: ZAP handlers are per context, and one in the shared
            # context would also judge every other socket of this process.
            self.context = zmq.Context()
            self._zap = ZapHandler(self.context, self._curve_keys.allowed_client_keys)
        try:
            self.producer = self._bind(host, producer_port, "producer")
            self.trainer = self._bind(host, trainer_port, "trainer")
        except OSError:
            self._close_security()
            raise
        self._waiting: list[_WaitingGet] = []
        self._running = True

    def _bind(self, host: str, port: int, name: str) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(
            zmq.ROUTER_MANDATORY, 0
        )  # a vanished peer's reply is dropped, not an error
        if self._curve_keys is not None:
            secure_server(socket, self._curve_keys, name)
            # Handshakes that fail before the allow-list is asked (a client without
            # CURVE, a wrong server key) are seen only through the socket's monitor.
            self._monitors[socket.get_monitor_socket(_HANDSHAKE_FAILURES)] = name
        try:
            socket.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as error:
            socket.close()
            raise OSError(f"buffer: cannot listen on {host}:{port}: {error}") from None
        return socket

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        name = self._monitors[monitor]
        for _ in range(1000):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            COUNTERS.inc(DENIED_COUNTER, reason="handshake_failed")
            if not self._handshake_failure_logged:
                self._handshake_failure_logged = True
                log.warning(
                    "refused a connection on the %s socket: the CURVE handshake failed "
                    "(a client without CURVE or with the wrong server key?); further "
                    "failures are counted in %s, not logged",
                    name,
                    DENIED_COUNTER,
                    extra={"zmq_event": event.get("event"), "zmq_value": event.get("value")},
                )

    def _close_security(self) -> None:
        for monitor in self._monitors:
            monitor.close(0)
        self._monitors.clear()
        if self._zap is not None:
            self._zap.close()
            self._zap = None
            self.context.term()

    @property
    def endpoints(self) -> dict[str, str]:
        return {
            "producer": self.producer.getsockopt_string(zmq.LAST_ENDPOINT),
            "trainer": self.trainer.getsockopt_string(zmq.LAST_ENDPOINT),
        }

    def stop(self) -> None:
        self._running = False

    def serve(self, poll_ms: int = 50) -> None:
        poller = zmq.Poller()
        poller.register(self.producer, zmq.POLLIN)
        poller.register(self.trainer, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.socket, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        while self._running:
            events = dict(poller.poll(poll_ms))
            if self._zap is not None and self._zap.socket in events:
                self._zap.handle()
            for monitor in self._monitors:
                if monitor in events:
                    self._on_monitor(monitor)
            if self.producer in events:
                self._drain(self.producer, self._on_producer)
            if self.trainer in events:
                self._drain(self.trainer, self._on_trainer)
            self._serve_waiting()
        for socket in (self.producer, self.trainer):
            if self._monitors:
                socket.disable_monitor()
            socket.close(0)
        self._close_security()
        if self.trajectory_log is not None:
            self._make_durable()
            self.trajectory_log.close()

    def _drain(self, socket: zmq.Socket, handler) -> None:
        replies = []
        for _ in range(1000):  # bounded, so one busy socket cannot starve the other
            try:
                parts = socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            identity, body = parts[0], parts[1:]
            try:
                reply = handler(identity, body)
            except Exception as error:  # a bug on one message must not end the buffer
                log.exception("buffer failed on a message")
                COUNTERS.inc("buffer_internal_errors")
                reply = [b"error", f"internal error: {type(error).__name__}: {error}".encode()]
            if reply is not None:
                replies.append([identity, *reply])
        self._make_durable()  # one fsync for the whole burst, before any of its acks
        for reply in replies:
            socket.send_multipart(reply)

    def _make_durable(self) -> str | None:
        """Writes what changed and flushes; returns what went wrong, or None."""
        journal = self.state.take_journal()
        if self.trajectory_log is None:
            return None
        try:
            self.trajectory_log.write(journal, self.state.ledger)
            self.trajectory_log.flush()
        except LogWriteError as error:
            # Kept for the next write: replaying a record twice changes nothing.
            self.state.journal[:0] = journal
            COUNTERS.inc("buffer_storage_errors")
            log.error("cannot write the trajectory log: %s", error)
            return f"storage: {error}"
        return None

    def _on_producer(self, identity: bytes, body: list[bytes]) -> list[bytes] | None:
        kind = body[0] if body else b""
        if kind == b"status":
            return [b"status", _json(self.state.status())]
        if kind == b"ledger":
            return [
                b"ledger",
                _json({**self.state.ledger.snapshot(), **self.state.held_ordinals()}),
            ]
        if kind == b"put_group" and len(body) >= 3 and len(body[1]) == 8:
            results = [self._put_frame(frame) for frame in body[2:]]
            return [
                b"ack",
                body[1],
                _json(
                    {
                        "results": [{"accepted": a, "reason": r} for a, r in results],
                        "trainer_version": self.state.trainer_version,
                    }
                ),
            ]
        if kind == b"drop" and len(body) == 3 and len(body[1]) == 8:
            accepted, reason = self._drop_ordinal(body[2])
            return [b"ack", body[1], _json(self._put_answer(accepted, reason))]
        if len(body) != 3 or kind != b"put" or len(body[1]) != 8:
            COUNTERS.inc("buffer_bad_messages", socket="producer")
            return [
                b"error",
                b"expected [put, 8-byte seq, frame], [put_group, 8-byte seq, frame...], "
                b"[drop, 8-byte seq, json], [ledger] or [status]",
            ]
        accepted, reason = self._put_frame(body[2])
        return [b"ack", body[1], _json(self._put_answer(accepted, reason))]

    def _put_answer(self, accepted: bool, reason: str) -> dict[str, Any]:
        return {
            "accepted": accepted,
            "reason": reason,
            "trainer_version": self.state.trainer_version,
            "trainer_step": self.state.trainer_step,
        }

    def _drop_ordinal(self, body: bytes) -> tuple[bool, str]:
        try:
            request = json.loads(body)
            ordinal, group_id = int(request["ordinal"]), str(request["group_id"])
            outcome = str(request["outcome"])
            if ordinal < 0 or not outcome:
                raise ValueError("ordinal must be >= 0 and outcome non-empty")
        except (ValueError, KeyError, TypeError) as error:
            COUNTERS.inc("buffer_bad_messages", socket="producer")
            return False, f"bad drop: expected {{ordinal, group_id, outcome}}: {error}"
        fresh = self.state.drop_ordinal(ordinal, group_id, outcome)
        failure = self._make_durable()
        if failure is not None:
            return False, failure
        return True, "ok" if fresh else "duplicate"

    def _put_frame(self, frame: bytes) -> tuple[bool, str]:
        try:
            trajectory = decode_trajectory(frame, self.max_frame_bytes)
        except WireError as error:
            COUNTERS.inc("buffer_bad_frames")
            return False, f"bad frame: {error}"
        return self._accept(trajectory, frame)

    def _accept(self, trajectory: Trajectory, frame: bytes) -> tuple[bool, str]:
        """Logs, then holds, a trajectory the state would take; a log that cannot be
        written refuses it with a "storage:" reason (producers wait and retry)."""
        if self.trajectory_log is not None:
            if self.state.check(trajectory)[1] != "ok":
                return self.state.put(trajectory)  # counts duplicates, refuses the rest
            try:
                self.trajectory_log.append_trajectory(trajectory.trajectory_id, frame)
            except LogWriteError as error:
                COUNTERS.inc("buffer_storage_errors")
                return False, f"storage: {error}"
            self.state.add(trajectory)
            return True, "ok"
        return self.state.put(trajectory)

    def _on_trainer(self, identity: bytes, body: list[bytes]) -> list[bytes] | None:
        kind = body[0] if body else b""
        try:
            request = json.loads(body[1]) if len(body) > 1 else {}
            if not isinstance(request, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as error:
            COUNTERS.inc("buffer_bad_messages", socket="trainer")
            return [b"error", f"bad JSON body: {error}".encode()]
        if kind == b"status":
            return [b"status", _json(self.state.status())]
        if kind == b"ack":
            self._note_version(request)
            ids = request.get("trajectory_ids")
            ids = [str(i) for i in ids] if isinstance(ids, list) else None
            known = self.state.ack(
                str(request.get("batch_id", "")), ids, commit=request.get("commit", True) is True
            )
            return self._durable_answer(b"acked", {"known": known})
        if kind == b"commit":
            self._note_version(request)
            groups = self.state.commit(_ids(request.get("trajectory_ids")))
            return self._durable_answer(b"committed", {"groups": groups})
        if kind == b"resume":
            self._note_version(request)
            if isinstance(request.get("trainer_step"), int):
                self.state.trainer_step = request["trainer_step"]  # back to its checkpoint
            counts = self.state.resume(_ids(request.get("committed_ids")))
            self._waiting.clear()  # requests of the trainer that died
            log.info("the trainer resumed from its checkpoint", extra=counts)
            return self._durable_answer(b"resumed", counts)
        if kind == b"get":
            self._note_version(request)
            groups = int(request.get("groups", 1))
            if groups < 1:
                return [b"error", b"groups must be at least 1"]
            wait = max(0.0, float(request.get("wait_ms", 0)) / 1000)
            self._waiting.append(_WaitingGet(identity, groups, time.monotonic() + wait))
            self._serve_waiting()
            return None
        COUNTERS.inc("buffer_bad_messages", socket="trainer")
        return [b"error", b"expected get, ack, commit, resume or status"]

    def _durable_answer(self, kind: bytes, body: dict[str, Any]) -> list[bytes]:
        """The answer once what the request changed is on disk, or an error saying why not
        (the trainer retries; replaying the request changes nothing twice)."""
        failure = self._make_durable()
        if failure is not None:
            return [b"error", failure.encode()]
        return [kind, _json({**body, "trainer_version": self.state.trainer_version})]

    def _note_version(self, request: dict[str, Any]) -> None:
        version = request.get("trainer_version")
        if isinstance(version, int) and version > self.state.trainer_version:
            self.state.trainer_version = version
        step = request.get("trainer_step")
        if isinstance(step, int) and step > self.state.trainer_step:
            self.state.trainer_step = step

    def _serve_waiting(self) -> None:
        now = time.monotonic()
        still = []
        for waiting in self._waiting:
            batch = self.state.take(waiting.groups)
            self._make_durable()  # groups dropped as stale are consumed
            if batch is not None:
                self.trainer.send_multipart([waiting.identity, b"batch", encode(batch)])
            elif now >= waiting.deadline:
                self.trainer.send_multipart(
                    [waiting.identity, b"empty", _json(self.state.status())]
                )
            else:
                still.append(waiting)
        self._waiting = still


def run_buffer(config: Any) -> int:
    """`rollwire buffer`: serve until SIGTERM/SIGINT; returns the exit code."""
    from rollwire.services.core.server import write_atomically
    from rollwire.services.core.telemetry import configure_logging

    configure_logging("buffer", config.telemetry.log_level, config.telemetry.log_format)
    section = config.buffer
    state = BufferState(
        group_size=config.rl.group_size,
        max_staleness=config.rl.staleness,
        max_ready_groups=section.max_ready_groups,
        shares=dict(section.batch_shares),
        share_by=section.share_by,
    )
    trajectory_log = None
    try:
        if section.durable:
            directory = section.data_dir or Path(config.run.output_dir) / "buffer"
            trajectory_log = TrajectoryLog(directory, section.log_sync, section.log_segment_bytes)
            restored = trajectory_log.restore(state, section.max_frame_bytes)
            state.requeue_unacked()
            log.info(
                "trajectory log open",
                extra={"directory": str(directory), "restored": restored, "seen": len(state.seen)},
            )
        server = BufferServer(
            state,
            section.host,
            section.producer_port,
            section.trainer_port,
            section.max_frame_bytes,
            section.curve,
            trajectory_log,
        )
    except (OSError, ValueError, LogError, WireError) as error:
        if trajectory_log is not None:
            trajectory_log.close()
        log.error("cannot start: %s", error)
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    if section.ready_file is not None:
        write_atomically(Path(section.ready_file), json.dumps(server.endpoints) + "\n")
    log.info("serving", extra=server.endpoints)
    server.serve()
    if section.ready_file is not None and Path(section.ready_file).exists():
        Path(section.ready_file).unlink()
    log.info("stopped", extra={"status": state.status(), "counters": COUNTERS.snapshot()})
    return 0
