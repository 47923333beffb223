"""Clients of the replay buffer: producers (orchestrators) and the trainer.

Both speak the protocol in `rollwire.services.buffer.protocol` over a DEALER socket,
send and read its records, and never wait without a timeout. A producer re-sends
a put that was not acknowledged in time (through
`rollwire.services.core.retry.call_with_retries`), with the same sequence number
and trajectory id; the buffer keeps one copy, so a retry can never duplicate a
trajectory.

With CURVE configured (`client.curve`) both clients encrypt and present this
client's key. A buffer that refuses the key never answers, so such a client ends
in the usual "did not answer" timeout, whose message then points at the keys.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, TypeVar

import zmq
import zmq.asyncio

from rollwire.services.buffer import protocol
from rollwire.services.buffer.protocol import (
    AckRequest,
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
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, call_with_retries
from rollwire.services.core.wire import Batch, Trajectory, decode_batch, encode

if TYPE_CHECKING:
    from rollwire.services.core.config.models import CurveClientConfig

_CURVE_HINT = (
    "; CURVE is on: check that this client's public key is among the buffer's "
    "allowed client keys and that client.curve names the buffer's public key"
)


R = TypeVar("R", bound=Record)


class BufferError(RuntimeError):
    """The buffer refused a request or did not answer in time."""


class _NoAnswer(Exception):
    """One try of a producer's request went unanswered within its timeout (retried)."""


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
    """Sends trajectories to the buffer and waits for each acknowledgement (asyncio)."""

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
        # The timeout is the wait between tries: no pause on top of it.
        self._resends = RetryPolicy(attempts=attempts, first_pause=0.0, max_pause=0.0)
        self._curve = _client_keys(curve)
        self._socket = _dealer(zmq.asyncio.Context.instance(), endpoint, self._curve)
        self._lock = asyncio.Lock()
        self._seq = 0

    async def _request(self, parts: list[bytes], expect: bytes, seq: bytes | None) -> list[bytes]:
        """The buffer's answer to `parts`: the first reply of kind `expect` (echoing `seq`,
        when given), sent again each time `timeout` passes without one, `attempts` tries
        in all. An [error] reply ends it at once."""

        async def one_try() -> list[bytes]:
            deadline = time.monotonic() + self.timeout
            if not await self._send(parts, deadline):
                raise _NoAnswer
            while (remaining := deadline - time.monotonic()) > 0:
                if not await self._socket.poll(remaining * 1000, zmq.POLLIN):
                    break
                reply = await self._socket.recv_multipart()
                if reply[0] == protocol.ERROR:
                    raise BufferError(
                        f"buffer at {self.endpoint} refused the request: "
                        f"{reply[1].decode(errors='replace')}"
                    )
                if reply[0] == expect and (seq is None or reply[1] == seq):
                    return reply
                # An answer to an earlier, retried request: ignore it.
            raise _NoAnswer

        async with self._lock:  # one request in flight, so replies match their request
            try:
                return await call_with_retries(
                    one_try,
                    self._resends,
                    what=f"buffer {parts[0].decode(errors='replace')}",
                    retryable=lambda error: isinstance(error, _NoAnswer),
                    on_retry=lambda _, __: COUNTERS.inc("buffer_resends"),
                )
            except _NoAnswer:
                raise BufferError(
                    f"buffer at {self.endpoint} did not answer {self.attempts} tries of "
                    f"{self.timeout:g}s" + (_CURVE_HINT if self._curve is not None else "")
                ) from None

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
        """Sends several trajectories (a group) in one message and one round trip; one
        answer per trajectory, in order."""
        seq = self._next_seq()
        frames = [encode(t) for t in trajectories]
        reply = await self._request([protocol.PUT_GROUP, seq, *frames], protocol.ACK, seq)
        answer = _answer(PutGroupAnswer, reply[2], self.endpoint)
        try:
            return answer.answers()
        except ProtocolError as error:
            raise BufferError(
                f"buffer at {self.endpoint} sent a malformed answer: {error}"
            ) from None

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
        self._socket.close(0)


class BufferTrainerClient:
    """The trainer's side: ask for a batch, acknowledge it once trained (blocking calls)."""

    def __init__(
        self, endpoint: str, timeout: float = 30.0, curve: CurveClientConfig | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._curve = _client_keys(curve)
        self._socket = _dealer(zmq.Context.instance(), endpoint, self._curve)

    def _call(self, parts: list[bytes], expect: tuple[bytes, ...], timeout: float) -> list[bytes]:
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
        """A batch of `groups` whole groups, or None if none was ready within `wait_seconds`."""
        request = GetRequest(trainer_version, groups, int(wait_seconds * 1000), trainer_step)
        reply = self._call(
            [protocol.GET, request.encode()],
            (protocol.BATCH, protocol.EMPTY),
            wait_seconds + self.timeout,
        )
        return decode_batch(reply[1]) if reply[0] == protocol.BATCH else None

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
        request = AckRequest(batch_id, trainer_version, commit, trajectory_ids, trainer_step)
        self._call([protocol.ACK, request.encode()], (protocol.ACKED,), self.timeout)

    def commit(self, trajectory_ids: list[str]) -> int:
        """A checkpoint now holds these: the buffer lets them go. Returns the groups committed."""
        body = CommitRequest(trajectory_ids).encode()
        reply = self._call([protocol.COMMIT, body], (protocol.COMMITTED,), self.timeout)
        return _answer(CommitAnswer, reply[1], self.endpoint).groups

    def resume(
        self, committed_ids: list[str], trainer_version: int, trainer_step: int
    ) -> ResumeAnswer:
        """Tells the buffer this trainer restarted from a checkpoint holding `committed_ids`:
        they are let go, and everything served to the trainer after them comes again."""
        body = ResumeRequest(committed_ids, trainer_version, trainer_step).encode()
        reply = self._call([protocol.RESUME, body], (protocol.RESUMED,), self.timeout)
        return _answer(ResumeAnswer, reply[1], self.endpoint)

    def status(self) -> BufferStatus:
        """What the buffer holds and has done."""
        reply = self._call([protocol.STATUS], (protocol.STATUS,), self.timeout)
        return _answer(BufferStatus, reply[1], self.endpoint)

    def close(self) -> None:
        self._socket.close(0)
