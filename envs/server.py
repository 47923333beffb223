"""The env-server: `rollwire.v1.EnvService` over the sessions of a `SessionHost`.

The session rules (idle expiry, limits, error codes and messages, counters)
live in `rollwire.envs.host`; this module only translates. A unary call that
the host refuses ends with that gRPC status; on the `Multiplex` stream the same
refusal becomes a `CallError` reply with the same code and message, and the
stream carries on. The server keeps serving through every bad input.

Multiplex, in order of what matters:
- Every call read is answered exactly once, by call_id. Replies that are ready
  together go out in one `EnvReplyBatch`; while one batch is being written the
  next one fills up.
- Calls to one session run in the order they arrived on the stream; calls to
  different sessions may run concurrently.
- Envs without `blocking = True` run inline as each frame is read, with no task
  or thread per call (the fast path). A blocking env's calls run in the host's
  thread pool, chained per session, so a step that waits seconds on a
  subprocess delays only its own session.
- A call whose call_id is still unanswered on this stream is a client bug: it
  is refused with INVALID_ARGUMENT (counted as
  `env_rejected{reason=duplicate_call_id}`) and does not run; the first call
  with that id still gets its own reply. A call that names no reset, step or
  close is refused the same way (`reason=empty_call`).
- At shutdown (`close`), streams stop reading, finish the calls they took,
  write the last replies and end; a client sees the stream end and fails
  whatever it had not yet been answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import grpc.aio
from google.protobuf import struct_pb2

from rollwire.envs.base import Observation, StepResult, parts
from rollwire.envs.host import EnvCallError, SessionHost
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.config import EnvServerConfig
from rollwire.services.core.images import to_proto
from rollwire.services.core.metrics import COUNTERS, GAUGES
from rollwire.services.core.server import Registration
from rollwire.services.core.structs import from_struct

log = logging.getLogger(__name__)
SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name
MULTIPLEX_METHOD = f"/{SERVICE_NAME}/Multiplex"

STATUS_BY_NAME: dict[str, grpc.StatusCode] = {code.name: code for code in grpc.StatusCode}
_NUMBER_BY_NAME: dict[str, int] = {code.name: code.value[0] for code in grpc.StatusCode}


def fill_struct(struct: struct_pb2.Struct, data: dict[str, Any]) -> None:
    """Writes a JSON-like dict into `struct`.

    Plain data goes in directly; anything Struct cannot hold (non-str keys,
    numpy scalars, objects) goes through JSON with str() as the fallback,
    which is what `rollwire.services.core.structs.to_struct` does for every dict.
    """
    try:
        struct.update(data)
    except (TypeError, ValueError, AttributeError):
        struct.Clear()
        struct.update(json.loads(json.dumps(data, default=str)))


def _observe(
    reply: env_pb2.ResetResponse | env_pb2.StepResponse, observation: str | Observation
) -> None:
    """Writes an observation, and the pictures it shows, into a Reset or Step reply."""
    text, images = parts(observation)
    reply.observation = text
    reply.images.extend(to_proto(image) for image in images)


def _status(code: str) -> grpc.StatusCode:
    return STATUS_BY_NAME.get(code, grpc.StatusCode.UNKNOWN)


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    """Hosts sessions of registered environments over gRPC."""

    def __init__(
        self,
        config: EnvServerConfig,
        clock: Callable[[], float] = time.monotonic,
        host: SessionHost | None = None,
    ) -> None:
        self.config = config
        self.host = host if host is not None else SessionHost(config, clock=clock)
        self._streams: set[_MultiplexStream] = set()
        self._stopping = False
        GAUGES.register(
            "env_open_sessions", lambda: self.host.session_count, "sessions open on this server"
        )

    @property
    def session_count(self) -> int:
        return self.host.session_count

    async def close(self) -> None:
        """Ends open Multiplex streams after the calls they took, then closes every session.

        `run_service` calls this on SIGTERM before the gRPC server's grace period.
        """
        self._stopping = True
        streams = list(self._streams)
        for stream in streams:
            stream.stop_reading()
        finished = [stream.finished for stream in streams if not stream.finished.done()]
        if finished:
            await asyncio.wait(finished, timeout=self.config.server.grace_seconds)
        # Clients close their sessions when they stop; what is left here they did not.
        log.info(
            "closing the sessions left open",
            extra={
                "open_sessions": self.host.session_count,
                "sessions_opened": COUNTERS.get("env_sessions_opened"),
            },
        )
        self.host.close_all()

    async def ListEnvs(
        self, request: env_pb2.ListEnvsRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ListEnvsResponse:
        return env_pb2.ListEnvsResponse(
            envs=[
                env_pb2.EnvSpec(
                    env_id=s.env_id,
                    description=s.description,
                    domain=s.domain,
                    gives_reward=s.gives_reward,
                )
                for s in self.host.specs()
            ]
        )

    async def Reset(
        self, request: env_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ResetResponse:
        kwargs = from_struct(request.env_kwargs) if request.HasField("env_kwargs") else {}
        seed = request.seed if request.HasField("seed") else None
        try:
            session_id, observation, info = await self.host.reset_async(
                request.env_id, seed, kwargs
            )
        except EnvCallError as error:
            await context.abort(_status(error.code), error.message)
        reply = env_pb2.ResetResponse(session_id=session_id)
        _observe(reply, observation)
        if info:
            fill_struct(reply.info, info)
        return reply

    async def Step(
        self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.StepResponse:
        try:
            observation, reward, terminated, truncated, info = await self.host.step_async(
                request.session_id, request.action
            )
        except EnvCallError as error:
            await context.abort(_status(error.code), error.message)
        reply = env_pb2.StepResponse(reward=reward, terminated=terminated, truncated=truncated)
        _observe(reply, observation)
        if info:
            fill_struct(reply.info, info)
        return reply

    async def Close(
        self, request: env_pb2.CloseRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.CloseResponse:
        return env_pb2.CloseResponse(existed=await self.host.close_async(request.session_id))

    async def Multiplex(
        self,
        request_iterator: AsyncIterator[env_pb2.EnvCallBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[env_pb2.EnvReplyBatch]:
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the env server is shutting down")
        stream = _MultiplexStream(self.host)
        self._streams.add(stream)
        reader = asyncio.ensure_future(stream.read(request_iterator))
        stream.reader = reader
        try:
            while True:
                stream.ready.clear()
                if stream.outbox.replies:
                    yield stream.take_outbox()
                elif stream.reading_done and not stream.tasks:
                    break
                else:
                    await stream.ready.wait()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # retrieved, so asyncio does not report it as lost
            for task in list(stream.tasks):
                task.cancel()
            self._streams.discard(stream)
            if not stream.finished.done():
                stream.finished.set_result(None)


class _MultiplexStream:
    """The state of one Multiplex call: replies waiting to go out, calls still running."""

    def __init__(self, host: SessionHost) -> None:
        self.host = host
        self.outbox = env_pb2.EnvReplyBatch()
        self._outbox_ids: list[int] = []
        self._unanswered: set[int] = set()
        self.ready = asyncio.Event()
        self.reading_done = False
        self.reader: asyncio.Future[None] | None = None
        # The last queued call of each session that has one, for per-session order.
        self._tails: dict[str, asyncio.Task[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def stop_reading(self) -> None:
        """Takes no more frames; what was read is still answered."""
        if self.reader is not None:
            self.reader.cancel()

    def take_outbox(self) -> env_pb2.EnvReplyBatch:
        batch, self.outbox = self.outbox, env_pb2.EnvReplyBatch()
        self._unanswered.difference_update(self._outbox_ids)
        self._outbox_ids = []
        return batch

    async def read(self, requests: AsyncIterator[env_pb2.EnvCallBatch]) -> None:
        try:
            async for batch in requests:
                for call in batch.calls:
                    self._run(call)
                if self.outbox.replies:
                    self.ready.set()
        finally:
            self.reading_done = True
            self.ready.set()

    # ------------------------------------------------------------ dispatch

    def _run(self, call: env_pb2.EnvCall) -> None:
        call_id = call.call_id
        if call_id in self._unanswered:
            COUNTERS.inc("env_rejected", reason="duplicate_call_id")
            self._error_reply(
                call_id,
                "INVALID_ARGUMENT",
                f"call_id {call_id} is already in flight on this stream; "
                "call ids must be unique among unanswered calls",
                track=False,
            )
            return
        self._unanswered.add(call_id)
        kind = call.WhichOneof("call")
        try:
            if kind == "step":
                request = call.step
                session_id = request.session_id
                if session_id in self._tails or self.host.session_is_blocking(session_id):
                    action = request.action
                    self._queue(session_id, lambda: self._step_later(call_id, session_id, action))
                else:
                    self._step_reply(call_id, self.host.step(session_id, request.action))
            elif kind == "close":
                session_id = call.close.session_id
                if session_id in self._tails:
                    self._queue(session_id, lambda: self._close_later(call_id, session_id))
                else:
                    self._close_reply(call_id, self.host.close(session_id))
            elif kind == "reset":
                self._spawn(self._reset_later(call_id, call.reset))
            else:
                COUNTERS.inc("env_rejected", reason="empty_call")
                self._error_reply(
                    call_id,
                    "INVALID_ARGUMENT",
                    f"call {call_id} carries no reset, step or close",
                )
        except EnvCallError as error:
            self._error_reply(call_id, error.code, error.message)
        except Exception as error:  # a bug here must not end every session's stream
            self._internal_error(call_id, kind, error)

    def _queue(self, session_id: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs `work()` after the session's previously queued call has finished."""
        previous = self._tails.get(session_id)
        task = self._spawn(_after(previous, work))
        self._tails[session_id] = task

        def untail(done: asyncio.Task[None]) -> None:
            if self._tails.get(session_id) is done:
                del self._tails[session_id]

        task.add_done_callback(untail)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.ready.set()

    async def _step_later(self, call_id: int, session_id: str, action: str) -> None:
        try:
            self._step_reply(call_id, await self.host.step_async(session_id, action))
        except EnvCallError as error:
            self._error_reply(call_id, error.code, error.message)
        except Exception as error:
            self._internal_error(call_id, "step", error)

    async def _close_later(self, call_id: int, session_id: str) -> None:
        try:
            self._close_reply(call_id, await self.host.close_async(session_id))
        except Exception as error:
            self._internal_error(call_id, "close", error)

    async def _reset_later(self, call_id: int, request: env_pb2.ResetRequest) -> None:
        try:
            kwargs = from_struct(request.env_kwargs) if request.HasField("env_kwargs") else {}
            seed = request.seed if request.HasField("seed") else None
            session_id, observation, info = await self.host.reset_async(
                request.env_id, seed, kwargs
            )
        except EnvCallError as error:
            self._error_reply(call_id, error.code, error.message)
            return
        except Exception as error:
            self._internal_error(call_id, "reset", error)
            return
        reply = self._new_reply(call_id)
        reset = reply.reset
        reset.session_id = session_id
        _observe(reset, observation)
        if info:
            fill_struct(reset.info, info)

    # ------------------------------------------------------------ replies

    def _new_reply(self, call_id: int) -> env_pb2.EnvReply:
        reply = self.outbox.replies.add()
        reply.call_id = call_id
        self._outbox_ids.append(call_id)
        return reply

    def _step_reply(self, call_id: int, result: StepResult) -> None:
        observation, reward, terminated, truncated, info = result
        step = self._new_reply(call_id).step
        step.SetInParent()  # an all-default step must still arrive as a step
        _observe(step, observation)
        step.reward = reward
        step.terminated = terminated
        step.truncated = truncated
        if info:
            fill_struct(step.info, info)

    def _close_reply(self, call_id: int, existed: bool) -> None:
        close = self._new_reply(call_id).close
        close.SetInParent()
        close.existed = existed

    def _error_reply(self, call_id: int, code: str, message: str, track: bool = True) -> None:
        reply = self.outbox.replies.add()
        reply.call_id = call_id
        if track:
            self._outbox_ids.append(call_id)
        error = reply.error
        error.code = _NUMBER_BY_NAME.get(code, grpc.StatusCode.UNKNOWN.value[0])
        error.message = message

    def _internal_error(self, call_id: int, kind: str | None, error: Exception) -> None:
        log.exception("unhandled error in a multiplexed %s call", kind)
        COUNTERS.inc("rpc_internal_errors", method=MULTIPLEX_METHOD)
        self._error_reply(
            call_id,
            "INTERNAL",
            f"internal error in a multiplexed {kind} call: {type(error).__name__}: {error}",
        )


async def _after(
    previous: asyncio.Task[None] | None, work: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Runs `work()` once `previous` has finished, whatever its outcome (it reported its own)."""
    if previous is not None and not previous.done():
        await asyncio.wait((previous,))
    await work()


def registrations(config: EnvServerConfig) -> list[Registration]:
    """What `rollwire env-server` hosts."""
    return [
        Registration(
            env_pb2_grpc.add_EnvServiceServicer_to_server, EnvServicer(config), SERVICE_NAME
        )
    ]
