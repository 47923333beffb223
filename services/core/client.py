"""Client side of the runtime: channels with deadlines, auth and tracing, and a
wait for a peer to report SERVING."""

from __future__ import annotations

import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from rollwire.services.core.config import ClientConfig
from rollwire.services.core.interceptors import ClientInterceptor
from rollwire.services.core.retry import RetryPolicy, TryAgain, call_with_retries


def describe_error(error: BaseException) -> str:
    """One line for a person: "CODE: details" for an RPC error, the message otherwise."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client; presents a certificate when one is configured (mTLS)."""
    if config.tls is None:
        return None
    tls = config.tls
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_file.read_bytes() if tls.ca_file else None,
        private_key=tls.key_file.read_bytes() if tls.key_file else None,
        certificate_chain=tls.cert_file.read_bytes() if tls.cert_file else None,
    )


def open_channel(
    address: str,
    config: ClientConfig | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `address` that puts a deadline, the token and trace context on every call."""
    config = config or ClientConfig()
    interceptor = ClientInterceptor(
        default_timeout=config.default_timeout_seconds,
        token=config.auth.resolve_token(),
        tracer_provider=tracer_provider,
    )
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # gRPC shares connections between channels to one address by default, and
        # with them a failed connection's back-off: a channel opened to a server that
        # was just restarted on its old port would fail for seconds without trying.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    credentials = channel_credentials(config)
    if credentials is None:
        return grpc.aio.insecure_channel(
            address, options=options, interceptors=interceptor.interceptors()
        )
    if config.tls is not None and config.tls.server_name:
        options.append(("grpc.ssl_target_name_override", config.tls.server_name))
    return grpc.aio.secure_channel(
        address, credentials, options=options, interceptors=interceptor.interceptors()
    )


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout: float = 5.0) -> str:
    """The peer's health status name (SERVING, NOT_SERVING, ...) for `service`."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_for_serving(
    channel: grpc.aio.Channel, service: str = "", timeout: float = 30.0, target: str = "the peer"
) -> None:
    """Polls the health service until it reports SERVING.

    `target` names the peer in the error message (usually its address).

    Raises:
        TimeoutError: after `timeout` seconds, saying what the peer last answered.
    """
    deadline = time.monotonic() + timeout
    last = "no answer"

    async def serving() -> None:
        nonlocal last
        try:
            status = await check_health(
                channel, service, timeout=min(max(deadline - time.monotonic(), 0.01), 2.0)
            )
        except grpc.aio.AioRpcError as error:
            status = f"{error.code().name}: {error.details()}"
        if status != "SERVING":
            last = status
            raise TryAgain(status)

    try:
        await call_with_retries(
            serving,
            RetryPolicy(attempts=None, first_pause=0.02, max_pause=0.5, total_seconds=timeout),
            what=f"{target} health",
        )
    except TimeoutError:
        raise TimeoutError(
            f"{target} did not report SERVING for service {service!r} within {timeout:g}s; last: {last}"
        ) from None
