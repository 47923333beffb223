"""One async interface to environment sessions, in this process or on an env-server.

    envs: EnvBackend = LocalEnvs(EnvServerConfig())           # in-process
    envs: EnvBackend = RemoteEnvs("10.0.0.5:7001", ClientConfig())  # over gRPC
    session_id, observation, info = await envs.reset("guess_the_number", seed=3)
    observation, reward, terminated, truncated, info = await envs.step(session_id, "50")
    await envs.close(session_id)

The agent loop cannot tell the two apart: the same calls, the same results
(info and kwargs pass through the same JSON-like conversion as the wire, so an
integral 3.0 comes back as 3 either way) and the same errors. Every refusal is
an `EnvCallError` whose `code` is a gRPC status name ("NOT_FOUND",
"INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "INTERNAL")
and whose message says what to do.

Failure guarantees of `RemoteEnvs`, which an orchestrator over several servers
relies on:
- Every call ends within `ClientConfig.default_timeout_seconds` (plus at most
  a tenth of it): with its result, its error, or `EnvCallError("DEADLINE_EXCEEDED")`.
  After a timeout the session's state is unknown: close it and start over.
- When the server cannot be reached or the connection breaks (server killed,
  connection reset, shut down), every call in flight fails at once with
  `EnvServerLost` (code "UNAVAILABLE"); nothing waits for its timeout. Sessions
  on that server should be taken as gone.
- A later call opens a new stream; it fails fast with `EnvServerLost` while the
  server stays down, and reaches it again once it is back (sessions opened
  before are then NOT_FOUND if the server restarted).
- Calls are never retried: a step that may have been applied is not repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

import grpc
import grpc.aio
from opentelemetry import trace

from rollwire.envs.base import EnvSpec, Observation, StepResult
from rollwire.envs.host import EnvCallError, ResetResult, SessionHost
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import ClientConfig, EnvServerConfig
from rollwire.services.core.images import of_protos
from rollwire.services.core.structs import from_struct, to_struct

__all__ = [
    "EnvBackend",
    "EnvCallError",
    "EnvServerLost",
    "LocalEnvs",
    "RemoteEnvs",
]

log = logging.getLogger(__name__)

_NAME_BY_NUMBER: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}

STREAM_ROTATE_SECONDS = 900.0
"""A Multiplex stream older than this takes no new calls: the next call opens a
fresh one and the old one ends once its calls are answered. Streams carry a
gRPC deadline like every call, and rotating keeps them far from it."""


class EnvServerLost(EnvCallError):
    """The env server is unreachable or the connection to it broke (code "UNAVAILABLE").

    Raised for every call that was in flight, as soon as the break is seen.
    The sessions on that server should be taken as lost.
    """

    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


@runtime_checkable
class EnvBackend(Protocol):
    """Environment sessions, wherever they run."""

    address: str
    """`host:port` of the env server, or "local" for sessions in this process."""

    async def list_envs(self) -> list[EnvSpec]:
        """The environments offered, sorted by id."""
        ...

    async def reset(
        self, env_id: str, seed: int | None = None, kwargs: dict[str, Any] | None = None
    ) -> ResetResult:
        """Opens a session: (session_id, observation, info)."""
        ...

    async def step(self, session_id: str, action: str) -> StepResult:
        """(observation, reward, terminated, truncated, info)."""
        ...

    async def close(self, session_id: str) -> bool:
        """Ends a session; False when it was unknown or had expired."""
        ...

    async def aclose(self) -> None:
        """Releases the backend (connections, or in-process sessions)."""
        ...


def _as_on_the_wire(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as it arrives after a trip through a protobuf Struct."""
    return from_struct(to_struct(data))


class LocalEnvs:
    """Sessions in this process, on a `SessionHost` with the env-server's rules.

    Blocking envs (`blocking = True`) run in the host's thread pool, as on a
    server; the others run inline on the event loop.
    """

    address = "local"

    def __init__(self, config: EnvServerConfig | None = None, host: SessionHost | None = None):
        self.host = host if host is not None else SessionHost(config or EnvServerConfig())

    async def list_envs(self) -> list[EnvSpec]:
        return self.host.specs()

    async def reset(
        self, env_id: str, seed: int | None = None, kwargs: dict[str, Any] | None = None
    ) -> ResetResult:
        session_id, observation, info = await self.host.reset_async(
            env_id, seed, _as_on_the_wire(kwargs) if kwargs else {}
        )
        return session_id, observation, _as_on_the_wire(info) if info else {}

    async def step(self, session_id: str, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = await self.host.step_async(
            session_id, action
        )
        return observation, reward, terminated, truncated, _as_on_the_wire(info) if info else {}

    async def close(self, session_id: str) -> bool:
        return await self.host.close_async(session_id)

    async def aclose(self) -> None:
        self.host.close_all()


# A call waiting for its reply: (future, deadline on the loop clock, kind, arguments).
_Pending = tuple[asyncio.Future[Any], float, str, tuple[Any, ...]]


class RemoteEnvs:
    """Sessions on one env-server, over one Multiplex stream (or unary calls).

    Calls issued in the same event-loop turn travel in one `EnvCallBatch`, and
    replies are matched to callers by call_id. A server that answers Multiplex
    with UNIMPLEMENTED is used through unary calls from then on, and the calls
    that were waiting are sent again that way (they never ran). With
    `multiplex=False` every call is a unary RPC. See the module docstring for
    timeouts and failures.
    """

    def __init__(
        self,
        address: str,
        client: ClientConfig | None = None,
        multiplex: bool = True,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.address = address
        self.config = client or ClientConfig()
        self.timeout = self.config.default_timeout_seconds
        self._tracer_provider = tracer_provider
        self._unary = not multiplex
        self._channel: grpc.aio.Channel | None = None
        self._stub: env_pb2_grpc.EnvServiceStub | None = None
        self._stream: _Stream | None = None
        self._streams: set[_Stream] = set()
        self._call_ids = itertools.count(1)
        self._resent: set[asyncio.Task[Any]] = set()  # held so they are not collected mid-call
        self._session_order = _SessionOrder()
        self._closed = False

    @property
    def multiplexing(self) -> bool:
        """False once the client uses unary calls (asked to, or the server has no Multiplex)."""
        return not self._unary

    # ------------------------------------------------------------ the interface

    async def list_envs(self) -> list[EnvSpec]:
        try:
            reply = await self._get_stub().ListEnvs(env_pb2.ListEnvsRequest())
        except grpc.aio.AioRpcError as error:
            raise self._rpc_error(error, "ListEnvs") from None
        specs = [EnvSpec(s.env_id, s.description, s.domain, s.gives_reward) for s in reply.envs]
        return sorted(specs, key=lambda spec: spec.env_id)

    async def reset(
        self, env_id: str, seed: int | None = None, kwargs: dict[str, Any] | None = None
    ) -> ResetResult:
        args = (env_id, seed, kwargs)
        if self._unary:
            return await self._call_unary("reset", args)
        return await self._call_stream("reset", args)

    async def step(self, session_id: str, action: str) -> StepResult:
        args = (session_id, action)
        if self._unary:
            return await self._call_unary("step", args)
        return await self._call_stream("step", args)

    async def close(self, session_id: str) -> bool:
        args = (session_id,)
        if self._unary:
            return await self._call_unary("close", args)
        return await self._call_stream("close", args)

    async def aclose(self) -> None:
        """Fails calls in flight with CANCELLED, ends the streams and closes the channel."""
        self._closed = True
        for stream in list(self._streams):
            stream.fail_all(lambda: EnvCallError("CANCELLED", f"{self._name} was closed"))
            stream.shut()
        self._streams.clear()
        self._stream = None
        for task in list(self._resent):
            task.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ------------------------------------------------------------ plumbing

    @property
    def _name(self) -> str:
        return f"the env client for {self.address}"

    def _get_stub(self) -> env_pb2_grpc.EnvServiceStub:
        if self._closed:
            raise EnvCallError("CANCELLED", f"{self._name} is closed")
        if self._stub is None:
            self._channel = open_channel(self.address, self.config, self._tracer_provider)
            self._stub = env_pb2_grpc.EnvServiceStub(self._channel)
        return self._stub

    def _rpc_error(self, error: grpc.aio.AioRpcError, what: str) -> EnvCallError:
        code = error.code()
        details = error.details() or code.name
        if code is grpc.StatusCode.UNAVAILABLE:
            return EnvServerLost(f"env server {self.address} is unavailable ({what}): {details}")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return _deadline_error(self.address, what, self.timeout)
        return EnvCallError(code.name, details)

    async def _call_unary(
        self, kind: str, args: tuple[Any, ...], timeout: float | None = None
    ) -> Any:
        if kind == "reset":
            return await self._send_unary(kind, args, timeout)
        # Two unary calls may reach the server in either order; a session's calls
        # go one at a time, as they do on a stream, so they run in the order made.
        async with self._session_order.turn(args[0]):
            return await self._send_unary(kind, args, timeout)

    async def _send_unary(self, kind: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        stub = self._get_stub()
        try:
            if kind == "step":
                session_id, action = args
                reply = await stub.Step(
                    env_pb2.StepRequest(session_id=session_id, action=action), timeout=timeout
                )
                return _step_result(reply)
            if kind == "reset":
                env_id, seed, kwargs = args
                request = env_pb2.ResetRequest(env_id=env_id, seed=seed)
                if kwargs:
                    request.env_kwargs.CopyFrom(to_struct(kwargs))
                reply = await stub.Reset(request, timeout=timeout)
                return _reset_result(reply)
            (session_id,) = args
            reply = await stub.Close(env_pb2.CloseRequest(session_id=session_id), timeout=timeout)
            return reply.existed
        except grpc.aio.AioRpcError as error:
            raise self._rpc_error(error, kind) from None

    async def _call_stream(self, kind: str, args: tuple[Any, ...]) -> Any:
        stream = self._stream
        loop = asyncio.get_running_loop()
        now = loop.time()
        if stream is None or stream.broken or now > stream.retire_at:
            stream = self._open_stream(loop)
        future = loop.create_future()
        stream.submit(next(self._call_ids), kind, args, future, now + self.timeout)
        return await future

    def _open_stream(self, loop: asyncio.AbstractEventLoop) -> _Stream:
        if self._stream is not None:
            self._stream.retire()
        stub = self._get_stub()
        stream = _Stream(self, loop)
        # The stream's own deadline lies past its retirement plus the last
        # calls' timeout, so it ends by rotation, never by its deadline.
        stream.start(stub, STREAM_ROTATE_SECONDS + 2 * self.timeout + 60.0)
        self._stream = stream
        self._streams.add(stream)
        return stream

    def _stream_ended(self, stream: _Stream) -> None:
        self._streams.discard(stream)
        if self._stream is stream:
            self._stream = None

    def _fall_back_to_unary(self, pending: list[_Pending]) -> None:
        """The server has no Multiplex: send the waiting calls (which never ran) as unary calls."""
        if not self._unary:
            log.info("env server %s has no Multiplex; using unary calls", self.address)
        self._unary = True
        loop = asyncio.get_running_loop()
        for future, deadline, kind, args in pending:
            if not future.done():
                remaining = max(deadline - loop.time(), 0.001)
                task = loop.create_task(self._call_unary(kind, args, timeout=remaining))
                self._resent.add(task)
                task.add_done_callback(self._resent.discard)
                task.add_done_callback(lambda done, future=future: _settle(future, done))


class _SessionOrder:
    """One call at a time per session, in the order the calls were made (asyncio locks are FIFO)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, session_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(session_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[session_id]

    def __len__(self) -> int:
        return len(self._locks)


def _settle(future: asyncio.Future[Any], task: asyncio.Task[Any]) -> None:
    """Passes `task`'s outcome on to `future` (unless its caller has gone)."""
    if future.done():
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as lost
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        future.set_result(task.result())


def _deadline_error(address: str, what: str, timeout: float) -> EnvCallError:
    return EnvCallError(
        "DEADLINE_EXCEEDED",
        f"env server {address} did not answer a {what} call within {timeout:g}s; "
        "the session's state is unknown: close it and start the episode again",
    )


def _info(struct_holder: Any) -> dict[str, Any]:
    return from_struct(struct_holder.info) if struct_holder.HasField("info") else {}


def _observation(reply: env_pb2.ResetResponse | env_pb2.StepResponse) -> str | Observation:
    """A reply's observation: its text, or an Observation when it shows pictures."""
    if reply.images:
        return Observation(reply.observation, tuple(of_protos(reply.images)))
    return reply.observation


def _step_result(step: env_pb2.StepResponse) -> StepResult:
    return _observation(step), step.reward, step.terminated, step.truncated, _info(step)


def _reset_result(reset: env_pb2.ResetResponse) -> ResetResult:
    return reset.session_id, _observation(reset), _info(reset)


class _Stream:
    """One Multiplex call: a batch being filled, the calls waiting for replies, a reader."""

    def __init__(self, owner: RemoteEnvs, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.loop = loop
        self.pending: dict[int, _Pending] = {}
        self.batch = env_pb2.EnvCallBatch()
        self.wake = asyncio.Event()
        self.broken = False
        self._retired = False
        self.retire_at = loop.time() + STREAM_ROTATE_SECONDS
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    def start(self, stub: env_pb2_grpc.EnvServiceStub, deadline_seconds: float) -> None:
        self._call = stub.Multiplex(self._requests(), timeout=deadline_seconds)
        self._reader = self.loop.create_task(self._read())
        self._watchdog = self.loop.create_task(self._expire())

    # ------------------------------------------------------------ sending

    def submit(
        self,
        call_id: int,
        kind: str,
        args: tuple[Any, ...],
        future: asyncio.Future[Any],
        deadline: float,
    ) -> None:
        call = self.batch.calls.add()
        call.call_id = call_id
        if kind == "step":
            step = call.step
            step.SetInParent()
            step.session_id, step.action = args
        elif kind == "reset":
            env_id, seed, kwargs = args
            reset = call.reset
            reset.SetInParent()
            reset.env_id = env_id
            if seed is not None:
                reset.seed = seed
            if kwargs:
                reset.env_kwargs.CopyFrom(to_struct(kwargs))
        else:
            close = call.close
            close.SetInParent()
            close.session_id = args[0]
        self.pending[call_id] = (future, deadline, kind, args)
        self.wake.set()

    async def _requests(self) -> AsyncIterator[env_pb2.EnvCallBatch]:
        """The request side of the stream: whatever calls gathered since the last write."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.batch.calls:
                batch, self.batch = self.batch, env_pb2.EnvCallBatch()
                yield batch
            if self._retired:
                return  # half-close: the server answers what it has, then ends the stream

    def retire(self) -> None:
        """Takes no new calls; ends once the calls already sent are answered."""
        self._retired = True
        self.wake.set()

    def shut(self) -> None:
        """Ends the stream now, answered or not (the caller has failed what was pending)."""
        self.retire()
        self.broken = True
        if self._call is not None:
            self._call.cancel()
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()

    # ------------------------------------------------------------ receiving

    async def _read(self) -> None:
        reason = "the server ended the stream (shutting down?)"
        try:
            async for batch in self._call:
                self._deliver(batch)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code is grpc.StatusCode.UNIMPLEMENTED:
                pending, self.pending = list(self.pending.values()), {}
                self._end(None)
                self.owner._fall_back_to_unary(pending)
                return
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                details = error.details() or code.name
                self._end(lambda: EnvCallError(code.name, details))
                return
            reason = f"{code.name}: {error.details()}"
        except asyncio.CancelledError:
            self._end(None)
            raise
        except Exception as error:  # a transport surprise must still fail the calls, not hang them
            reason = f"{type(error).__name__}: {error}"
        address = self.owner.address
        lost = len(self.pending)
        self._end(
            lambda: EnvServerLost(
                f"env server {address} is lost: {reason}; "
                f"{lost} call(s) in flight failed and its sessions may be gone"
            )
        )

    def _deliver(self, batch: env_pb2.EnvReplyBatch) -> None:
        pending = self.pending
        for reply in batch.replies:
            entry = pending.pop(reply.call_id, None)
            if entry is None:
                continue  # timed out already
            future = entry[0]
            if future.done():
                continue  # its caller was cancelled
            kind = reply.WhichOneof("reply")
            if kind == "step":
                future.set_result(_step_result(reply.step))
            elif kind == "error":
                error = reply.error
                future.set_exception(
                    EnvCallError(_NAME_BY_NUMBER.get(error.code, "UNKNOWN"), error.message)
                )
            elif kind == "reset":
                future.set_result(_reset_result(reply.reset))
            elif kind == "close":
                future.set_result(reply.close.existed)
            else:
                future.set_exception(
                    EnvCallError(
                        "INTERNAL",
                        f"env server {self.owner.address} sent an empty reply to call {reply.call_id}",
                    )
                )

    def _end(self, failure: Any) -> None:
        self.broken = True
        self.retire()  # lets gRPC's task that drains `_requests` finish too
        self._stop_watchdog()
        self.owner._stream_ended(self)
        if failure is not None:
            self.fail_all(failure)

    def fail_all(self, failure: Any) -> None:
        """Fails every waiting call with a fresh `failure()` exception."""
        pending, self.pending = self.pending, {}
        for future, _, _, _ in pending.values():
            if not future.done():
                future.set_exception(failure())

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    async def _expire(self) -> None:
        """Fails calls past their deadline. Deadlines grow with call order, so it
        looks only at the oldest; it wakes ten times per timeout."""
        timeout = self.owner.timeout
        period = timeout / 10
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            pending = self.pending
            while pending:
                call_id, (future, deadline, kind, _) = next(iter(pending.items()))
                if deadline > now:
                    break
                del pending[call_id]
                if not future.done():
                    future.set_exception(_deadline_error(self.owner.address, kind, timeout))
            if self._retired and not pending:
                self.shut()
                return
