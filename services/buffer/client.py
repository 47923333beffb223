"""Clients of the replay buffer: producers (orchestrators) and the trainer.

Both speak the protocol in `rollwire.services.buffer.server` over a DEALER socket and
never wait without a timeout. A producer re-sends a put that was not
acknowledged in time, with the same sequence number and trajectory id; the
buffer keeps one copy, so a retry can never duplicate a trajectory.

With CURVE configured (`client.curve`) both clients encrypt and present this
client's key. A buffer that refuses the key never answers, so such a client ends
in the usual "did not answer" timeout, whose message then points at the keys.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from rollwire.services.core.curve import ClientKeys, client_keys, secure_client
from rollwire.services.core.wire import Batch, Trajectory, decode_batch, encode

if TYPE_CHECKING:
    from rollwire.services.core.config.models import CurveClientConfig

_CURVE_HINT = (
    "; CURVE is on: check that this client's public key is among the buffer's "
    "allowed client keys and that client.curve names the buffer's public key"
)


class BufferError(RuntimeError):
    """The buffer refused a request or did not answer in time."""


@dataclass
class PutResult:
    accepted: bool
    reason: str
    trainer_version: int


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
        self._curve = _client_keys(curve)
        self._socket = _dealer(zmq.asyncio.Context.instance(), endpoint, self._curve)
        self._lock = asyncio.Lock()
        self._seq = 0

    async def _request(self, parts: list[bytes], expect: bytes, seq: bytes | None) -> list[bytes]:
        async with self._lock:
            for _ in range(self.attempts):
                deadline = time.monotonic() + self.timeout
                if not await self._send(parts, deadline):
                    continue
                while (remaining := deadline - time.monotonic()) > 0:
                    if not await self._socket.poll(remaining * 1000, zmq.POLLIN):
                        break
                    reply = await self._socket.recv_multipart()
                    if reply[0] == b"error":
                        raise BufferError(
                            f"buffer at {self.endpoint} refused the request: {reply[1].decode(errors='replace')}"
                        )
                    if reply[0] == expect and (seq is None or reply[1] == seq):
                        return reply
                    # An answer to an earlier, retried request: ignore it.
            raise BufferError(
                f"buffer at {self.endpoint} did not answer {self.attempts} tries of {self.timeout:g}s"
                + (_CURVE_HINT if self._curve is not None else "")
            )

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

    async def put(self, trajectory: Trajectory) -> PutResult:
        """Sends one trajectory; returns once the buffer has acknowledged it."""
        self._seq += 1
        seq = self._seq.to_bytes(8, "big")
        reply = await self._request([b"put", seq, encode(trajectory)], b"ack", seq)
        body = json.loads(reply[2])
        return PutResult(body["accepted"], body["reason"], body["trainer_version"])

    async def put_group(self, trajectories: list[Trajectory]) -> list[PutResult]:
        """Sends several trajectories (a group) in one message and one round trip; one
        result per trajectory, in order."""
        self._seq += 1
        seq = self._seq.to_bytes(8, "big")
        frames = [encode(t) for t in trajectories]
        reply = await self._request([b"put_group", seq, *frames], b"ack", seq)
        body = json.loads(reply[2])
        version = body["trainer_version"]
        return [PutResult(r["accepted"], r["reason"], version) for r in body["results"]]

    async def drop(self, ordinal: int, group_id: str, outcome: str) -> PutResult:
        """Tells the buffer this prompt ends here (`outcome`: "filtered", "failed", ...),
        so its ordinal is accounted for and a restarted producer does not run it again."""
        self._seq += 1
        seq = self._seq.to_bytes(8, "big")
        body = json.dumps({"ordinal": ordinal, "group_id": group_id, "outcome": outcome})
        reply = await self._request([b"drop", seq, body.encode()], b"ack", seq)
        data = json.loads(reply[2])
        return PutResult(data["accepted"], data["reason"], data["trainer_version"])

    async def ledger(self) -> dict[str, Any]:
        """The buffer's ordinal ledger and the ordinals it holds (see services.ledger)."""
        reply = await self._request([b"ledger"], b"ledger", None)
        return json.loads(reply[1])

    async def status(self) -> dict[str, Any]:
        reply = await self._request([b"status"], b"status", None)
        return json.loads(reply[1])

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
        if reply[0] == b"error":
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
        request: dict[str, Any] = {
            "trainer_version": trainer_version,
            "groups": groups,
            "wait_ms": int(wait_seconds * 1000),
        }
        if trainer_step is not None:
            request["trainer_step"] = trainer_step
        reply = self._call(
            [b"get", json.dumps(request).encode()],
            (b"batch", b"empty"),
            wait_seconds + self.timeout,
        )
        return decode_batch(reply[1]) if reply[0] == b"batch" else None

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
        request: dict[str, Any] = {
            "batch_id": batch_id,
            "trainer_version": trainer_version,
            "commit": commit,
        }
        if trajectory_ids is not None:
            request["trajectory_ids"] = trajectory_ids
        if trainer_step is not None:
            request["trainer_step"] = trainer_step
        self._call([b"ack", json.dumps(request).encode()], (b"acked",), self.timeout)

    def commit(self, trajectory_ids: list[str]) -> int:
        """A checkpoint now holds these: the buffer lets them go. Returns the groups committed."""
        body = json.dumps({"trajectory_ids": trajectory_ids}).encode()
        return json.loads(self._call([b"commit", body], (b"committed",), self.timeout)[1])["groups"]

    def resume(
        self, committed_ids: list[str], trainer_version: int, trainer_step: int
    ) -> dict[str, Any]:
        """Tells the buffer this trainer restarted from a checkpoint holding `committed_ids`:
        they are let go, and everything served to the trainer after them comes again."""
        body = json.dumps(
            {
                "committed_ids": committed_ids,
                "trainer_version": trainer_version,
                "trainer_step": trainer_step,
            }
        ).encode()
        return json.loads(self._call([b"resume", body], (b"resumed",), self.timeout)[1])

    def status(self) -> dict[str, Any]:
        return json.loads(self._call([b"status"], (b"status",), self.timeout)[1])

    def close(self) -> None:
        self._socket.close(0)
