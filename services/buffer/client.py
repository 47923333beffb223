"""Clients of the replay buffer: producers (orchestrators) and the trainer.

Both speak the protocol in `rollwire.services.buffer.protocol` over a DEALER socket,
send and read its records, and never wait without a timeout. A producer re-sends
a put that was not acknowledged in time, with the same sequence number and
trajectory id; the buffer keeps one copy, so a retry can never duplicate a
trajectory.

With CURVE configured (`client.curve`) both clients encrypt and present this
client's key. A buffer that refuses the key never answers, so such a client ends
in the usual "did not answer" timeout, whose message then points at the keys.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, TypeVar

import zmq
import zmq.asyncio

from rollwire.services.buffer import protocol
from rollwire.services.buffer.protocol import (
    AckRequest,
    BatchHeader,
    BufferStatus,
    CommitAnswer,
    CommitRequest,
    DropRequest,
    GetRequest,
    LedgerView,
    ProtocolError,
    PutAnswer,
    PutGroupAnswer,
    Record,
    ResumeAnswer,
    ResumeRequest,
)
from rollwire.services.core.curve import ClientKeys, client_keys, secure_client
from rollwire.services.core.group_frame import encode_group
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Batch,
    Trajectory,
    WireError,
    decode_trajectory,
    encode,
    peek,
)

if TYPE_CHECKING:
    from rollwire.services.core.config.models import CurveClientConfig

_CURVE_HINT = (
    "; CURVE is on: check that this client's public key is among the buffer's "
    "allowed client keys and that client.curve names the buffer's public key"
)


log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)


class BufferError(RuntimeError):
    """The buffer refused a request or did not answer in time."""


def _answer(record: type[R], body: bytes, endpoint: str) -> R:
    """The buffer's answer as `record`; a malformed one is a BufferError like any refusal."""
    try:
        return record.decode(body)
    except ProtocolError as error:
        raise BufferError(f"buffer at {endpoint} sent a malformed answer: {error}") from None


def _client_keys(curve: CurveClientConfig | None) -> ClientKeys | None:
    return None if curve is None else client_keys(curve)


def _dealer(context: zmq.Context, endpoint: str, curve: ClientKeys | None = None) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(socket, curve)
    socket.connect(endpoint)
    return socket


class BufferProducer:
    """Sends trajectories to the buffer and waits for each acknowledgement (asyncio).

    Any number of requests may be in flight at once (one per coroutine awaiting
    `put`, `put_group`, ...): each carries its own seq, and one reader hands every
    answer to the request it belongs to.
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float = 10.0,
        attempts: int = 6,
        curve: CurveClientConfig | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.attempts = attempts
        self._curve = _client_keys(curve)
        self._socket = _dealer(zmq.asyncio.Context.instance(), endpoint, self._curve)
        self._seq = 0
        self._by_seq: dict[bytes, asyncio.Future[list[bytes]]] = {}
        self._by_kind: dict[bytes, deque[asyncio.Future[list[bytes]]]] = {}  # status, ledger
        self._reader: asyncio.Task[None] | None = None

    def _start_reader(self) -> None:
        loop = asyncio.get_running_loop()
        reader = self._reader
        if reader is None or reader.done() or reader.get_loop() is not loop:
            self._reader = loop.create_task(self._read())

    async def _read(self) -> None:
        """Hands each answer to its request: by seq, or (status, ledger) to the oldest
        request of its kind; an [error] reply, which has no seq, to the oldest such."""
        while True:
            reply = await self._socket.recv_multipart()
            kind = reply[0]
            if kind == protocol.ACK and len(reply) >= 3:
                waiter = self._by_seq.get(reply[1])
            else:
                kinds = list(self._by_kind) if kind == protocol.ERROR else [kind]
                waiter = next(
                    (f for k in kinds for f in self._by_kind.get(k, ()) if not f.done()), None
                )
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)
            # Otherwise: an answer to a request already answered (and sent again) or given up.

    async def _request(self, parts: list[bytes], expect: bytes, seq: bytes | None) -> list[bytes]:
        """The buffer's answer to `parts`: the reply of kind `expect` (echoing `seq`, when
        given), sent again each time `timeout` passes without one, `attempts` tries in
        all. An [error] reply ends it at once."""
        self._start_reader()
        answer: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        if seq is not None:
            self._by_seq[seq] = answer
        else:
            self._by_kind.setdefault(expect, deque()).append(answer)
        try:
            for attempt in range(self.attempts):
                if attempt:
                    COUNTERS.inc("buffer_resends")
                    self._start_reader()  # in case it ended with the loop of an earlier call
                deadline = time.monotonic() + self.timeout
                if not await self._send(parts, deadline):
                    continue
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    reply = await asyncio.wait_for(asyncio.shield(answer), remaining)
                except TimeoutError:
                    continue
                if reply[0] == protocol.ERROR:
                    raise BufferError(
                        f"buffer at {self.endpoint} refused the request: "
                        f"{reply[1].decode(errors='replace') if len(reply) > 1 else ''}"
                    )
                return reply
            raise BufferError(
                f"buffer at {self.endpoint} did not answer {self.attempts} tries of "
                f"{self.timeout:g}s" + (_CURVE_HINT if self._curve is not None else "")
            )
        finally:
            if seq is not None:
                self._by_seq.pop(seq, None)
            else:
                self._by_kind[expect].remove(answer)
            if not answer.done():
                answer.cancel()

    async def _send(self, parts: list[bytes], deadline: float) -> bool:
        # A DEALER with no usable peer (e.g. after a refused CURVE handshake) would
        # block on send forever, so sending shares the request's deadline.
        while (remaining := deadline - time.monotonic()) > 0:
            if not await self._socket.poll(remaining * 1000, zmq.POLLOUT):
                return False
            try:
                await self._socket.send_multipart(parts, zmq.NOBLOCK)
                return True
            except zmq.Again:  # the peer went away between poll and send
                continue
        return False

    def _next_seq(self) -> bytes:
        self._seq += 1
        return self._seq.to_bytes(8, "big")

    async def put(self, trajectory: Trajectory) -> PutAnswer:
        """Sends one trajectory; returns once the buffer has acknowledged it."""
        seq = self._next_seq()
        reply = await self._request([protocol.PUT, seq, encode(trajectory)], protocol.ACK, seq)
        return _answer(PutAnswer, reply[2], self.endpoint)

    async def put_group(self, trajectories: list[Trajectory]) -> list[PutAnswer]:
        """Sends several trajectories (a group) as one group frame, in one round trip; one
        answer per trajectory, in order."""
        seq = self._next_seq()
        frame = encode_group([encode(t) for t in trajectories])
        reply = await self._request([protocol.PUT_GROUP, seq, frame], protocol.ACK, seq)
        answer = _answer(PutGroupAnswer, reply[2], self.endpoint)
        try:
            answers = answer.answers()
        except ProtocolError as error:
            raise BufferError(
                f"buffer at {self.endpoint} sent a malformed answer: {error}"
            ) from None
        if len(answers) == 1 < len(trajectories) and not answers[0].accepted:
            return answers * len(trajectories)  # the group frame itself was refused
        if len(answers) != len(trajectories):
            raise BufferError(
                f"buffer at {self.endpoint} answered {len(answers)} of {len(trajectories)} "
                "trajectories"
            )
        return answers

    async def drop(self, ordinal: int, group_id: str, outcome: str) -> PutAnswer:
        """Tells the buffer this prompt ends here (`outcome`: "filtered", "failed", ...),
        so its ordinal is accounted for and a restarted producer does not run it again.
        A request the buffer cannot take (a negative ordinal, say) comes back refused,
        with a reason starting "bad drop:"."""
        seq = self._next_seq()
        body = DropRequest(ordinal, group_id, outcome).encode()
        reply = await self._request([protocol.DROP, seq, body], protocol.ACK, seq)
        return _answer(PutAnswer, reply[2], self.endpoint)

    async def ledger(self) -> LedgerView:
        """The buffer's ordinal ledger and the ordinals it holds (see `buffer.ledger`)."""
        reply = await self._request([protocol.LEDGER], protocol.LEDGER, None)
        return _answer(LedgerView, reply[1], self.endpoint)

    async def status(self) -> BufferStatus:
        """What the buffer holds and has done."""
        reply = await self._request([protocol.STATUS], protocol.STATUS, None)
        return _answer(BufferStatus, reply[1], self.endpoint)

    def close(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self._socket.close(0)


class BufferTrainerClient:
    """The trainer's side: ask for a batch, acknowledge it once trained (blocking calls)."""

    def __init__(
        self,
        endpoint: str,
        timeout: float = 30.0,
        curve: CurveClientConfig | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        token: str | None = None,
    ) -> None:
        """`token`: the trainer's secret (`buffer.trainer_token_file`), sent with every
        get, ack, commit and resume."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._token = [] if token is None else [token.encode()]
        self._bad_ids: dict[str, list[str]] = {}  # batch id -> ids its ack reports as bad
        self._curve = _client_keys(curve)
        self._socket = _dealer(zmq.Context.instance(), endpoint, self._curve)
        # One request at a time: the socket is not thread-safe, and the trainer calls from
        # worker threads (its loop's get and ack beside a background checkpoint's commit),
        # whose replies would otherwise cross.
        self._lock = threading.Lock()

    def _call(self, parts: list[bytes], expect: tuple[bytes, ...], timeout: float) -> list[bytes]:
        with self._lock:
            return self._call_alone(parts, expect, timeout)

    def _call_alone(
        self, parts: list[bytes], expect: tuple[bytes, ...], timeout: float
    ) -> list[bytes]:
        deadline = time.monotonic() + timeout
        sent = self._send(parts, deadline)
        remaining = max(0.0, deadline - time.monotonic())
        if not sent or not self._socket.poll(remaining * 1000, zmq.POLLIN):
            # The request may still be answered later; a fresh socket keeps replies in step.
            self._socket.close(0)
            self._socket = _dealer(zmq.Context.instance(), self.endpoint, self._curve)
            raise BufferError(
                f"buffer at {self.endpoint} did not answer within {timeout:g}s"
                + (_CURVE_HINT if self._curve is not None else "")
            )
        reply = self._socket.recv_multipart()
        if reply[0] == protocol.ERROR:
            raise BufferError(
                f"buffer at {self.endpoint} refused the request: {reply[1].decode(errors='replace')}"
            )
        if reply[0] not in expect:
            raise BufferError(f"unexpected reply {reply[0]!r} from the buffer")
        return reply

    def _send(self, parts: list[bytes], deadline: float) -> bool:
        # A DEALER with no usable peer (e.g. after a refused CURVE handshake) would
        # block on send forever, so sending shares the call's deadline.
        while (remaining := deadline - time.monotonic()) > 0:
            if not self._socket.poll(remaining * 1000, zmq.POLLOUT):
                return False
            try:
                self._socket.send_multipart(parts, zmq.NOBLOCK)
                return True
            except zmq.Again:  # the peer went away between poll and send
                continue
        return False

    def get_batch(
        self,
        trainer_version: int,
        groups: int,
        wait_seconds: float,
        trainer_step: int | None = None,
    ) -> Batch | None:
        """A batch of `groups` whole groups, decoded, or None if none was ready within
        `wait_seconds`. A group with a frame that does not decode is left out (logged,
        counted in `buffer_bad_frames_served`) and let go by this batch's `ack`; a batch
        of such groups only is acknowledged here and None returned."""
        served = self.get_frames(trainer_version, groups, wait_seconds, trainer_step)
        if served is None:
            return None
        header, frames = served
        trajectories: list[Trajectory] = []
        bad: dict[str, str] = {}  # group id -> what was wrong with one of its frames
        bad_ids: list[str] = []
        for frame in frames:
            try:
                trajectories.append(decode_trajectory(frame, self.max_frame_bytes))
            except WireError as error:
                try:  # the buffer admitted it on these fields, so they read
                    held = peek(frame, self.max_frame_bytes)
                except WireError as unreadable:
                    raise BufferError(
                        f"buffer at {self.endpoint} served an unreadable frame: {unreadable}"
                    ) from None
                bad.setdefault(held.group_id, str(error))
                bad_ids.append(held.trajectory_id)
        if bad:
            # Frames the buffer admitted on their header but whose arrays break the
            # schema: their whole groups are left out, and the ack lets them go.
            kept = [t for t in trajectories if t.group_id not in bad]
            bad_ids += [t.trajectory_id for t in trajectories if t.group_id in bad]
            self._bad_ids[header.batch_id] = bad_ids
            COUNTERS.inc("buffer_bad_frames_served", amount=len(frames) - len(kept))
            log.error(
                "left out %d group(s) of batch %s that could not be decoded: %s",
                len(bad),
                header.batch_id,
                "; ".join(f"{group}: {problem}" for group, problem in bad.items()),
            )
            trajectories = kept
            if not trajectories:  # nothing left to train on: let the batch go now
                self.ack(header.batch_id, trainer_version, trainer_step=trainer_step)
                return None
        return Batch(header.batch_id, header.trainer_version, trajectories)

    def get_frames(
        self,
        trainer_version: int,
        groups: int,
        wait_seconds: float,
        trainer_step: int | None = None,
    ) -> tuple[BatchHeader, list[bytes]] | None:
        """A batch as the buffer sends it: its header and the trajectories' frames, not
        decoded; None if none was ready within `wait_seconds`."""
        request = GetRequest(trainer_version, groups, int(wait_seconds * 1000), trainer_step)
        reply = self._call(
            [protocol.GET, request.encode(), *self._token],
            (protocol.BATCH, protocol.EMPTY),
            wait_seconds + self.timeout,
        )
        if reply[0] != protocol.BATCH:
            return None
        header = _answer(BatchHeader, reply[1] if len(reply) > 1 else b"", self.endpoint)
        frames = reply[2:]
        if len(frames) != header.trajectories:
            raise BufferError(
                f"buffer at {self.endpoint} sent {len(frames)} frames for a batch of "
                f"{header.trajectories}"
            )
        return header, frames

    def ack(
        self,
        batch_id: str,
        trainer_version: int,
        trajectory_ids: list[str] | None = None,
        commit: bool = True,
        trainer_step: int | None = None,
    ) -> None:
        """Marks a batch trained and tells the buffer the new trainer version. With the
        batch's trajectory ids, a buffer restarted since it served the batch still
        knows what was trained. With `commit=False` the buffer keeps the batch until
        `commit` says a checkpoint holds it (or `resume` that none does)."""
        bad_ids = self._bad_ids.get(batch_id)
        if bad_ids and trajectory_ids is not None:
            trajectory_ids = [*trajectory_ids, *bad_ids]  # a restarted buffer finds them too
        request = AckRequest(
            batch_id, trainer_version, commit, trajectory_ids, trainer_step, bad_ids
        )
        self._call([protocol.ACK, request.encode(), *self._token], (protocol.ACKED,), self.timeout)
        self._bad_ids.pop(batch_id, None)

    def commit(self, trajectory_ids: list[str]) -> int:
        """A checkpoint now holds these: the buffer lets them go. Returns the groups committed."""
        body = CommitRequest(trajectory_ids).encode()
        reply = self._call(
            [protocol.COMMIT, body, *self._token], (protocol.COMMITTED,), self.timeout
        )
        return _answer(CommitAnswer, reply[1], self.endpoint).groups

    def resume(
        self, committed_ids: list[str], trainer_version: int, trainer_step: int
    ) -> ResumeAnswer:
        """Tells the buffer this trainer restarted from a checkpoint holding `committed_ids`:
        they are let go, and everything served to the trainer after them comes again."""
        body = ResumeRequest(committed_ids, trainer_version, trainer_step).encode()
        reply = self._call([protocol.RESUME, body, *self._token], (protocol.RESUMED,), self.timeout)
        return _answer(ResumeAnswer, reply[1], self.endpoint)

    def status(self) -> BufferStatus:
        """What the buffer holds and has done."""
        reply = self._call([protocol.STATUS], (protocol.STATUS,), self.timeout)
        return _answer(BufferStatus, reply[1], self.endpoint)

    def close(self) -> None:
        self._socket.close(0)
