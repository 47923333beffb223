"""The replay buffer's process: trajectories in from producers, whole groups out to the trainer.

Two ZeroMQ ROUTER sockets, one for producers (orchestrators) and one for the
trainer, so every message has an explicit answer. The messages, frame by frame,
and what a client may rely on are in `rollwire.services.buffer.protocol`; what
the buffer holds, and staleness, in `rollwire.services.buffer.state`. This module
decodes each request into its record, applies it to the `BufferState` and sends
the answer's record back.

A put is acknowledged once the trajectory is held in memory and written to the
buffer's log (`rollwire.services.buffer.trajectory_log`; a burst of puts shares
one fsync before their acks go out, per `buffer.log_sync`). If that fsync fails,
the burst's puts are taken back out of memory and refused ("storage: ..."), and
the log is reopened (re-read from disk) before it is written again.

A frame is checked in full before its put is acknowledged (`wire.admit`: every
field and array, as the trainer's decoding checks them), so a broken one is refused
to its producer ("bad frame: ...") rather than found by the trainer later; the
buffer then keeps and serves the bytes it was sent, never encoding one again.
Anything malformed gets an answer that says what was wrong, a counter
(`buffer_bad_messages`, `buffer_bad_frames`), and the buffer keeps serving. When
the log cannot be written (disk full, directory gone) puts are refused with a
reason starting "storage:", which producers treat like "full": they wait and
retry, they do not drop.

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
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from opentelemetry import propagate, trace
from zmq.utils.monitor import recv_monitor_message

from rollwire.services.buffer import protocol
from rollwire.services.buffer.durable_log import LogError, LogWriteError
from rollwire.services.buffer.protocol import (
    AckAnswer,
    AckRequest,
    BatchHeader,
    CommitAnswer,
    CommitRequest,
    DropRequest,
    GetRequest,
    ProtocolError,
    PutAnswer,
    PutGroupAnswer,
    Record,
    ResumeRequest,
)
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from rollwire.services.core.curve import DENIED_COUNTER, ZapHandler, secure_server, server_keys
from rollwire.services.core.group_frame import is_group, split_group
from rollwire.services.core.metrics import (
    COUNTERS,
    GAUGES,
    MetricsEndpoint,
    metrics_ready_file,
)
from rollwire.services.core.wire import TrajectoryFrame, WireError, admit

if TYPE_CHECKING:
    from rollwire.services.core.config.models import CurveServerConfig

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("rollwire.buffer")

_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


@dataclass
class _WaitingGet:
    identity: bytes
    groups: int
    deadline: float


@dataclass
class _PutReply:
    """A put's answer, encoded only once the burst it came in is durable (or is not)."""

    seq: bytes
    results: list[tuple[bool, str, str | None]]
    """(accepted, reason, trajectory id or None) for each frame, in order."""
    group: bool
    """Answered as a PutGroupAnswer (one entry per frame), else as one PutAnswer."""


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
        trainer_token: str | None = None,
    ) -> None:
        """With `curve`, both sockets are CURVE servers behind its client allow-list. With
        `trainer_token`, the trainer socket's get, ack, commit and resume must carry it.

        Raises:
            OSError: a port cannot be bound.
            rollwire.services.core.curve.CurveError: a CURVE key or key file is unusable.
        """
        self.state = state
        self.max_frame_bytes = max_frame_bytes
        self.trajectory_log = trajectory_log
        self._trainer_token = None if trainer_token is None else trainer_token.encode()
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
        self._unwritten: list[tuple[str, bytes]] = []  # accepted, not yet written to the log
        self._unsynced: set[str] = set()  # accepted since the last durable point
        self._lost: dict[str, str] = {}  # accepted in this burst, whose fsync failed: why
        self._next_reopen = 0.0

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
                self._drain(self.producer, self._on_producer, views=True)
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

    def _drain(self, socket: zmq.Socket, handler, views: bool = False) -> None:
        """Handles what `socket` has waiting (up to 1,000 messages), makes it durable,
        then answers. With `views`, a message's parts after its kind and seq (the frames)
        are views of what ZeroMQ received, held and logged and served without a copy."""
        replies: list[tuple[bytes, list[bytes] | _PutReply]] = []
        for _ in range(1000):  # bounded, so one busy socket cannot starve the other
            try:
                if views:
                    received = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    parts = [part.bytes for part in received[:3]]
                    parts += [part.buffer for part in received[3:]]
                else:
                    parts = socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            identity, body = parts[0], parts[1:]
            try:
                reply = handler(identity, body)
            except Exception as error:  # a bug on one message must not end the buffer
                log.exception("buffer failed on a message")
                COUNTERS.inc("buffer_internal_errors")
                reply = _internal_error(body, f"internal error: {type(error).__name__}: {error}")
            if reply is not None:
                replies.append((identity, reply))
        self._make_durable()  # one fsync for the whole burst, before any of its acks
        lost, self._lost = self._lost, {}
        for identity, reply in replies:
            if isinstance(reply, _PutReply):
                reply = self._encode_put(reply, lost)
            socket.send_multipart([identity, *reply])

    def _encode_put(self, reply: _PutReply, lost: dict[str, str]) -> list[bytes]:
        """The put's answer; a trajectory whose log write did not become durable is
        refused with the storage reason, so its producer sends it again."""
        results = [
            (False, lost[tid]) if tid in lost else (accepted, reason)
            for accepted, reason, tid in reply.results
        ]
        if reply.group:
            answer = PutGroupAnswer(
                [{"accepted": accepted, "reason": reason} for accepted, reason in results],
                self.state.trainer_version,
            )
            return [protocol.ACK, reply.seq, answer.encode()]
        return [protocol.ACK, reply.seq, self._put_answer(*results[0])]

    def _make_durable(self) -> str | None:
        """Writes what changed and makes it durable; returns what went wrong, or None.

        When that fails, every trajectory accepted since the last durable point is taken
        back out of the state and its ack refused ("storage: ..."): after a failed fsync
        the kernel may have dropped what was written, whatever a later read shows."""
        journal = self.state.take_journal()
        if self.trajectory_log is None:
            return None
        try:
            self._reopen_if_broken()
            if self._unwritten:  # the burst's accepted trajectories, in one write
                accepted, self._unwritten = self._unwritten, []
                self.trajectory_log.append_trajectories(accepted)
            self.trajectory_log.write(journal, self.state.ledger)
            self.trajectory_log.flush()
        except LogError as error:
            # Kept for the next write: replaying a record twice changes nothing.
            self.state.journal[:0] = journal
            COUNTERS.inc("buffer_storage_errors")
            reason = f"storage: {error}"
            log.error("cannot write the trajectory log: %s", error)
            if self._unsynced:
                COUNTERS.inc("buffer_puts_refused_unsynced", amount=len(self._unsynced))
                self.state.forget(self._unsynced)
                self.trajectory_log.forget(self._unsynced)
                self._lost.update(dict.fromkeys(self._unsynced, reason))
                self._unsynced = set()
            return reason
        self._unsynced = set()
        return None

    def _reopen_if_broken(self) -> None:
        """A log whose fsync failed is reopened (which re-reads it from disk) before it is
        written again, at most once a second; LogError while that does not work."""
        assert self.trajectory_log is not None
        broken = self.trajectory_log.broken
        if broken is None:
            return
        now = time.monotonic()
        if now < self._next_reopen:
            raise LogWriteError(broken)
        self._next_reopen = now + 1.0
        self.trajectory_log.reopen()
        COUNTERS.inc("buffer_log_reopens")
        log.warning("reopened the trajectory log after: %s", broken)

    def _on_producer(self, identity: bytes, body: list[bytes]) -> list[bytes] | _PutReply:
        kind = body[0] if body else b""
        if kind == protocol.STATUS:
            return [protocol.STATUS, self.state.status().encode()]
        if kind == protocol.LEDGER:
            return [protocol.LEDGER, self.state.ledger_view().encode()]
        if kind == protocol.PUT_GROUP and len(body) >= 3 and len(body[1]) == 8:
            frames = body[2:]
            if len(frames) == 1 and is_group(frames[0]):
                try:
                    frames = split_group(frames[0], self.max_frame_bytes)
                except WireError as error:  # one answer: the producer refuses every member
                    COUNTERS.inc("buffer_bad_frames")
                    return _PutReply(body[1], [(False, f"bad frame: {error}", None)], group=True)
            return _PutReply(body[1], [self._put_frame(frame) for frame in frames], group=True)
        if kind == protocol.DROP and len(body) == 3 and len(body[1]) == 8:
            return [protocol.ACK, body[1], self._put_answer(*self._drop_ordinal(body[2]))]
        if len(body) != 3 or kind != protocol.PUT or len(body[1]) != 8:
            COUNTERS.inc("buffer_bad_messages", socket="producer")
            return [
                protocol.ERROR,
                b"expected [put, 8-byte seq, frame], [put_group, 8-byte seq, frame...], "
                b"[drop, 8-byte seq, json], [ledger] or [status]",
            ]
        return _PutReply(body[1], [self._put_frame(body[2])], group=False)

    def _put_answer(self, accepted: bool, reason: str) -> bytes:
        state = self.state
        return PutAnswer(accepted, reason, state.trainer_version, state.trainer_step).encode()

    def _drop_ordinal(self, body: bytes) -> tuple[bool, str]:
        # A malformed drop is refused in its ack rather than answered [error]: the ack
        # carries the seq, so the producer cannot take it for another request's answer.
        try:
            request = DropRequest.decode(body)
        except ProtocolError as error:
            COUNTERS.inc("buffer_bad_messages", socket="producer")
            return False, f"bad drop: {error}"
        fresh = self.state.drop_ordinal(request.ordinal, request.group_id, request.outcome)
        failure = self._make_durable()
        if failure is not None:
            return False, failure
        return True, "ok" if fresh else "duplicate"

    def _put_frame(self, frame: bytes) -> tuple[bool, str, str | None]:
        try:
            trajectory = admit(frame, self.max_frame_bytes)
        except WireError as error:
            COUNTERS.inc("buffer_bad_frames")
            return False, f"bad frame: {error}", None
        if not trajectory.trace_context:
            return (*self._accept(trajectory), trajectory.trajectory_id)
        # The put joins the trajectory's trace (its group's, begun by the orchestrator).
        with _TRACER.start_as_current_span(
            "buffer put",
            context=propagate.extract(trajectory.trace_context),
            attributes={"rollwire.trajectory_id": trajectory.trajectory_id},
        ) as span:
            accepted, reason = self._accept(trajectory)
            span.set_attribute("rollwire.outcome", reason)
            return accepted, reason, trajectory.trajectory_id

    def _accept(self, trajectory: TrajectoryFrame) -> tuple[bool, str]:
        """Holds a trajectory the state would take, to be logged with the rest of its burst
        before any ack goes out (`_make_durable`); a log that cannot be written then
        refuses it with a "storage:" reason (producers wait and retry)."""
        accepted, reason = self.state.put(trajectory)
        if self.trajectory_log is not None and reason == "ok":
            self._unwritten.append((trajectory.trajectory_id, trajectory.frame))
            self._unsynced.add(trajectory.trajectory_id)
        return accepted, reason

    def _on_trainer(self, identity: bytes, body: list[bytes]) -> list[bytes] | None:
        kind = body[0] if body else b""
        if kind == protocol.STATUS:
            return [protocol.STATUS, self.state.status().encode()]
        record = _TRAINER_REQUESTS.get(kind)
        if record is None:
            COUNTERS.inc("buffer_bad_messages", socket="trainer")
            return [protocol.ERROR, b"expected get, ack, commit, resume or status"]
        if self._trainer_token is not None and not hmac.compare_digest(
            body[2] if len(body) > 2 else b"", self._trainer_token
        ):
            COUNTERS.inc("buffer_trainer_refused", kind=kind.decode(errors="replace"))
            return [protocol.ERROR, _NOT_THE_TRAINER]
        try:
            request = record.decode(body[1] if len(body) > 1 else b"")
        except ProtocolError as error:
            COUNTERS.inc("buffer_bad_messages", socket="trainer")
            return [protocol.ERROR, str(error).encode()]
        self._note_version(request.trainer_version, request.trainer_step)
        if isinstance(request, AckRequest):
            known = self.state.ack(
                request.batch_id, request.trajectory_ids, request.commit, request.bad_ids
            )
            return self._durable_answer(
                protocol.ACKED, AckAnswer(known, self.state.trainer_version)
            )
        if isinstance(request, CommitRequest):
            groups = self.state.commit(request.trajectory_ids)
            return self._durable_answer(
                protocol.COMMITTED, CommitAnswer(groups, self.state.trainer_version)
            )
        if isinstance(request, ResumeRequest):
            if request.trainer_step is not None:
                self.state.trainer_step = request.trainer_step  # back to its checkpoint
            answer = self.state.resume(request.committed_ids)
            self._waiting.clear()  # requests of the trainer that died
            log.info("the trainer resumed from its checkpoint", extra=asdict(answer))
            return self._durable_answer(protocol.RESUMED, answer)
        wait = max(0.0, request.wait_ms / 1000)
        self._waiting.append(_WaitingGet(identity, request.groups, time.monotonic() + wait))
        self._serve_waiting()
        return None

    def _durable_answer(self, kind: bytes, answer: Record) -> list[bytes]:
        """The answer once what the request changed is on disk, or an error saying why not
        (the trainer retries; replaying the request changes nothing twice)."""
        failure = self._make_durable()
        if failure is not None:
            return [protocol.ERROR, failure.encode()]
        return [kind, answer.encode()]

    def _note_version(self, version: int | None, step: int | None) -> None:
        """The trainer's version and step only move forward (a resume sets the step back)."""
        if version is not None and version > self.state.trainer_version:
            self.state.trainer_version = version
        if step is not None and step > self.state.trainer_step:
            self.state.trainer_step = step

    def _serve_waiting(self) -> None:
        now = time.monotonic()
        still = []
        for waiting in self._waiting:
            batch = self.state.take(waiting.groups)
            self._make_durable()  # groups dropped as stale are consumed
            if batch is not None:
                header = BatchHeader(batch.batch_id, batch.trainer_version, len(batch.trajectories))
                frames = [t.frame for t in batch.trajectories]
                self.trainer.send_multipart(
                    [waiting.identity, protocol.BATCH, header.encode(), *frames], copy=False
                )
            elif now >= waiting.deadline:
                empty = self.state.status().encode()
                self.trainer.send_multipart([waiting.identity, protocol.EMPTY, empty])
            else:
                still.append(waiting)
        self._waiting = still


_NOT_THE_TRAINER = (
    b"refused: a get, ack, commit or resume needs the trainer's token (buffer.trainer_token_file); "
    b"only the trainer takes batches, lets them go and moves trainer_version"
)


def _internal_error(body: list[bytes], message: str) -> list[bytes]:
    """The answer to a request the buffer failed on: a refused ack where the request had
    a seq (so a producer with several requests in flight knows which), else [error]."""
    kind = body[0] if body else b""
    has_seq = len(body) >= 3 and len(body[1]) == 8
    if has_seq and kind == protocol.PUT_GROUP:
        answers = [{"accepted": False, "reason": message} for _ in body[2:]]
        return [protocol.ACK, body[1], PutGroupAnswer(answers, 0).encode()]
    if has_seq and kind in (protocol.PUT, protocol.DROP):
        return [protocol.ACK, body[1], PutAnswer(False, message, 0, 0).encode()]
    return [protocol.ERROR, message.encode()]


_TRAINER_REQUESTS: dict[
    bytes, type[GetRequest] | type[AckRequest] | type[CommitRequest] | type[ResumeRequest]
] = {
    protocol.GET: GetRequest,
    protocol.ACK: AckRequest,
    protocol.COMMIT: CommitRequest,
    protocol.RESUME: ResumeRequest,
}


def run_buffer(config: Any) -> int:
    """`rollwire buffer`: serve until SIGTERM/SIGINT; returns the exit code."""
    from rollwire.services.core.server import write_atomically
    from rollwire.services.core.telemetry import configure_logging, configure_tracing

    configure_logging("buffer", config.telemetry.log_level, config.telemetry.log_format)
    provider = configure_tracing("buffer", config.telemetry.trace_exporter)
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
            section.trainer_token(),
        )
    except (OSError, ValueError, LogError, WireError) as error:
        if trajectory_log is not None:
            trajectory_log.close()
        log.error("cannot start: %s", error)
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    metrics = None
    if section.metrics_port is not None:
        GAUGES.register(
            "buffer",
            lambda: {
                field: float(value)
                for field, value in asdict(state.status()).items()
                if isinstance(value, int | float)
            },
            "what the buffer holds and has done (BufferStatus)",
            label="field",
        )
        ready = None if section.ready_file is None else Path(section.ready_file)
        metrics = MetricsEndpoint(section.host, section.metrics_port, metrics_ready_file(ready))
    if section.ready_file is not None:
        write_atomically(Path(section.ready_file), json.dumps(server.endpoints) + "\n")
    log.info("serving", extra=server.endpoints)
    try:
        server.serve()
    finally:
        if metrics is not None:
            metrics.close()
        if provider is not None:
            provider.shutdown()  # sends the spans still batched
    if section.ready_file is not None and Path(section.ready_file).exists():
        Path(section.ready_file).unlink()
    log.info("stopped", extra={"status": asdict(state.status()), "counters": COUNTERS.snapshot()})
    return 0
