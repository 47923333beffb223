"""gRPC interceptors: authentication, tracing, counters and deadlines.

Server side, one interceptor wraps every handler: it checks the bearer token,
opens a SERVER span joined to the caller's trace (W3C trace context carried in
the call metadata), counts calls by method and status, and turns an unexpected
exception into INTERNAL with a message instead of gRPC's bare UNKNOWN.

Client side, one interceptor gives every call a default deadline, attaches the
token, and opens a CLIENT span whose context it injects into the metadata.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import grpc.aio
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from rollwire.services.core.metrics import COUNTERS, Counters

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TRACER_NAME = "rollwire.grpc"


def _split_method(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


def _tracer(provider: trace.TracerProvider | None) -> trace.Tracer:
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


def _metadata_dict(metadata: Sequence[tuple[str, Any]] | None) -> dict[str, str]:
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}


def _abort_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    kind = _kind(handler)
    behaviour = deny_stream if handler.response_streaming else deny
    return handler._replace(**{kind: behaviour})


def _kind(handler: grpc.RpcMethodHandler) -> str:
    streaming = (
        "stream" if handler.request_streaming else "unary",
        "stream" if handler.response_streaming else "unary",
    )
    return f"{streaming[0]}_{streaming[1]}"


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Auth, tracing, counting and error shaping for every call a server takes."""

    def __init__(
        self,
        service: str,
        token: str | None = None,
        exempt_health: bool = True,
        tracer_provider: trace.TracerProvider | None = None,
        counters: Counters = COUNTERS,
    ) -> None:
        self.service = service
        self._expected = f"Bearer {token}".encode() if token else None
        self._exempt_health = exempt_health
        self._tracer = _tracer(tracer_provider)
        self._counters = counters

    def _authorized(self, method: str, metadata: dict[str, str]) -> bool:
        if self._expected is None or (self._exempt_health and method.startswith(HEALTH_PREFIX)):
            return True
        given = metadata.get("authorization", "").encode()
        return hmac.compare_digest(given, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        metadata = _metadata_dict(handler_call_details.invocation_metadata)
        if not self._authorized(method, metadata):
            self._counters.inc("rpc_unauthenticated", method=method)
            reason = "missing" if "authorization" not in metadata else "wrong"
            return _abort_handler(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{reason} bearer token: send 'authorization: Bearer <token>' metadata "
                f"with the token {self.service} was configured with",
            )
        kind = _kind(handler)
        behaviour = getattr(handler, kind)
        parent = propagate.extract(metadata)
        wrap = self._wrap_streaming if handler.response_streaming else self._wrap_unary
        replacements: dict[str, Any] = {kind: wrap(behaviour, method, parent)}
        if handler.request_deserializer is not None:
            # gRPC answers bytes its deserializer rejects with UNKNOWN and a traceback in
            # the log; rollwire answers INVALID_ARGUMENT, counted, from inside the call.
            replacements["request_deserializer"] = _lenient(handler.request_deserializer)
        return handler._replace(**replacements)

    def _start_span(self, method: str, parent: Any) -> trace.Span:
        service, name = _split_method(method)
        return self._tracer.start_span(
            method.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )

    async def _on_error(
        self, error: Exception, method: str, context: grpc.aio.ServicerContext
    ) -> None:
        if isinstance(error, grpc.aio.AbortError):
            raise error
        if isinstance(error, _BadRequest):
            self._counters.inc("rpc_undecodable_requests", method=method)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        log.exception("unhandled error in %s", method, extra={"method": method})
        self._counters.inc("rpc_internal_errors", method=method)
        await context.abort(
            grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}: {error}"
        )

    def _finish(self, span: trace.Span, method: str, context: grpc.aio.ServicerContext) -> None:
        code = context.code()
        if code is None:
            code = grpc.StatusCode.CANCELLED if context.cancelled() else grpc.StatusCode.OK
        if isinstance(code, int):  # some grpc versions report the raw integer
            code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, context.details() or code.name))
            self._counters.inc("rpc_errors", method=method, code=code.name)
        self._counters.inc("rpc_calls", method=method)
        span.end()

    def _wrap_unary(
        self, behaviour: Callable[..., Any], method: str, parent: Any
    ) -> Callable[..., Any]:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self._start_span(method, parent)
            try:
                with trace.use_span(span, end_on_exit=False, record_exception=False):
                    try:
                        return await behaviour(_checked(request, method), context)
                    except Exception as error:
                        await self._on_error(error, method, context)
            finally:
                self._finish(span, method, context)

        return traced

    def _wrap_streaming(
        self, behaviour: Callable[..., Any], method: str, parent: Any
    ) -> Callable[..., Any]:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span = self._start_span(method, parent)
            try:
                with trace.use_span(span, end_on_exit=False, record_exception=False):
                    try:
                        result = behaviour(_checked(request, method), context)
                        if inspect.isasyncgen(result):
                            async for item in result:
                                yield item
                        else:  # a handler that writes with context.write()
                            await result
                    except Exception as error:
                        await self._on_error(error, method, context)
            finally:
                self._finish(span, method, context)

        return traced


class _Undecodable:
    """What the lenient deserializer returns for bytes that are not the request message."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


class _BadRequest(Exception):
    """A request (or a message of a request stream) that could not be decoded."""


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:
            return _Undecodable(f"{type(error).__name__}: {error}")

    return decode


def _checked(request: Any, method: str) -> Any:
    """The request, or for a request stream an iterator over it, that raises _BadRequest
    at a message that could not be decoded."""

    def refuse(bad: _Undecodable) -> _BadRequest:
        return _BadRequest(f"{method}: the request could not be decoded: {bad.problem}")

    if isinstance(request, _Undecodable):
        raise refuse(request)
    if not hasattr(request, "__aiter__"):
        return request

    async def messages() -> AsyncIterator[Any]:
        async for message in request:
            if isinstance(message, _Undecodable):
                raise refuse(message)
            yield message

    return messages()


class ClientInterceptor:
    """Default deadline, bearer token and a CLIENT span on every outgoing call.

    grpc.aio files an interceptor under the first call type it implements only,
    so one object cannot cover all four; `interceptors()` gives one per type,
    sharing this object's settings.
    """

    def __init__(
        self,
        default_timeout: float,
        token: str | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._default_timeout = default_timeout
        self._token = token
        self._tracer = _tracer(tracer_provider)
        self._pending: set[asyncio.Task[None]] = set()

    def _prepare(
        self, details: grpc.aio.ClientCallDetails
    ) -> tuple[grpc.aio.ClientCallDetails, trace.Span]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, name = _split_method(method)
        span = self._tracer.start_span(
            method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in carrier.items():
            metadata.add(key, value)
        if self._token and "authorization" not in metadata:
            metadata.add("authorization", f"Bearer {self._token}")
        timeout = details.timeout if details.timeout is not None else self._default_timeout
        return (
            grpc.aio.ClientCallDetails(
                details.method, timeout, metadata, details.credentials, details.wait_for_ready
            ),
            span,
        )

    async def _finish(self, span: trace.Span, call: grpc.aio.Call) -> None:
        try:
            code = await call.code()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, await call.details() or code.name))
        finally:
            span.end()

    async def _intercept(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        new_details, span = self._prepare(details)
        if not span.is_recording():
            # No exporter: the span only carried the caller's context into the
            # metadata; skip the task that would wait for the status.
            span.end()
            return await continuation(new_details, request)
        try:
            call = await continuation(new_details, request)
        except BaseException:
            span.end()
            raise
        task = asyncio.get_running_loop().create_task(self._finish(span, call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return call

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """One interceptor for each of the four call types, for a channel's `interceptors`."""
        return [
            _UnaryUnary(self._intercept),
            _UnaryStream(self._intercept),
            _StreamUnary(self._intercept),
            _StreamStream(self._intercept),
        ]


class _ForwardingInterceptor:
    def __init__(self, intercept: Callable[..., Any]) -> None:
        self._intercept = intercept


class _UnaryUnary(_ForwardingInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return await self._intercept(continuation, details, request)


class _UnaryStream(_ForwardingInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return await self._intercept(continuation, details, request)


class _StreamUnary(_ForwardingInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[override]
        return await self._intercept(continuation, details, requests)


class _StreamStream(_ForwardingInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[override]
        return await self._intercept(continuation, details, requests)
