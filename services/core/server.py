"""The one way every rollwire gRPC service starts, serves and stops.

    runtime = ServiceRuntime("env-server", config.env_server.server)
    address = await runtime.start([Registration(add_EnvServiceServicer_to_server, servicer, "rollwire.v1.EnvService")])
    await runtime.serve_until_signalled()  # SIGTERM/SIGINT: NOT_SERVING, drain, exit 0

Binding port 0 picks a free port; the real address goes to the ready file once
the server answers health checks, so launchers and tests never race for ports.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from opentelemetry import trace

from rollwire.services.core.config import ServerConfig
from rollwire.services.core.files import write_atomically
from rollwire.services.core.interceptors import ServerInterceptor
from rollwire.services.core.metrics import COUNTERS, MetricsEndpoint, metrics_ready_file

log = logging.getLogger(__name__)

EXIT_NO_RESTART = 2
"""Exit code of a service that stopped on an error a restart cannot mend (its settings or
its data): the launcher reports it at once instead of restarting it. argparse's usage
errors exit with the same code."""
TRAINER_NODES_ENV = "ROLLWIRE_TRAINER_NODES"
"""Set by a launcher that runs the trainer's ranks on several machines (a Ray cluster's
nodes, `run.ray.trainer_nodes`): `NODES,NODE_RANK,HOST:PORT`, this machine's place among
them and rank 0's rendezvous address; the trainer's torchrun runs this machine's share.
Unset: every rank on this machine."""


@dataclass(frozen=True)
class Registration:
    """One gRPC service to host: the generated `add_*_to_server`, its servicer, its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    service_name: str


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config; mutual TLS when a client CA is given."""
    if config.tls is None:
        return None
    tls = config.tls
    assert tls.cert_file is not None and tls.key_file is not None  # checked by the config model
    client_ca = tls.ca_file.read_bytes() if tls.ca_file else None
    return grpc.ssl_server_credentials(
        [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


async def reject(
    context: grpc.aio.ServicerContext,
    service: str,
    code: grpc.StatusCode,
    reason: str,
    message: str,
) -> None:
    """Refuses a call: counts `<service>_rejected{reason}` and aborts with `code` and `message`.

    Raises (as `context.abort` does), so code after it runs only for good input.
    """
    COUNTERS.inc(f"{service}_rejected", reason=reason)
    await context.abort(code, message)


def _connectable_host(host: str) -> str:
    """The host a local client should dial for a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


class ServiceRuntime:
    """A grpc.aio server with health, auth, tracing, limits and a ready file."""

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.health = HealthServicer()
        self.address: str | None = None
        self._service_names: list[str] = []
        self.metrics: MetricsEndpoint | None = None
        self._stopped = asyncio.Event()
        self._token = config.auth.resolve_token()  # read once: it may come from a file
        interceptor = ServerInterceptor(
            name,
            token=self._token,
            exempt_health=config.auth.exempt_health,
            tracer_provider=tracer_provider,
        )
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            # Without this two servers can bind one fixed port and split its traffic.
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(
            interceptors=[interceptor],
            options=options,
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        )

    async def start(self, registrations: Sequence[Registration]) -> str:
        """Registers the services, binds, starts, reports SERVING and writes the ready file."""
        for registration in registrations:
            registration.add_to_server(registration.servicer, self.server)
            self._service_names.append(registration.service_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.config.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection(
                [
                    *self._service_names,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ],
                self.server,
            )
        bind = f"{self.config.host}:{self.config.port}"
        credentials = server_credentials(self.config)
        try:
            if credentials is None:
                port = self.server.add_insecure_port(bind)
            else:
                port = self.server.add_secure_port(bind, credentials)
        except RuntimeError as error:
            raise OSError(f"{self.name}: cannot listen on {bind}: {error}") from None
        if port == 0:
            raise OSError(f"{self.name}: cannot listen on {bind} (address in use or not local)")
        await self.server.start()
        self.address = f"{_connectable_host(self.config.host)}:{port}"
        for service_name in ["", *self._service_names]:
            await self.health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            self.metrics = MetricsEndpoint(
                self.config.host,
                self.config.metrics_port,
                metrics_ready_file(self.config.ready_file),
            )
        if self.config.ready_file is not None:
            write_atomically(self.config.ready_file, self.address + "\n")
        log.info(
            "serving",
            extra={
                "address": self.address,
                "services": self._service_names,
                "tls": self.config.tls is not None,
                "auth": self._token is not None,
            },
        )
        return self.address

    async def stop(self, grace: float | None = None) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish for `grace` seconds, then stops."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.health.enter_graceful_shutdown()
        grace = self.config.grace_seconds if grace is None else grace
        log.info("stopping", extra={"grace_seconds": grace})
        await self.server.stop(grace)
        ready = self.config.ready_file
        if ready is not None and ready.exists() and ready.read_text().strip() == self.address:
            ready.unlink()
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped", extra={"counters": COUNTERS.snapshot()})

    async def serve_until_signalled(
        self,
        extra_shutdown: Callable[[], Any] | None = None,
        fatal: Sequence[asyncio.Event] = (),
    ) -> int:
        """Serves until SIGTERM or SIGINT, then stops gracefully and returns 0; or until a
        servicer sets one of its `fatal` events (it cannot serve any more: say, its engine
        broke), then stops and returns 1, so that a supervisor starts it again."""
        loop = asyncio.get_running_loop()
        requested = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, requested.set)
        # Waiting for a signal is this process's whole life, so no timeout here;
        # a server that dies ends the wait too.
        termination = asyncio.ensure_future(self.server.wait_for_termination())
        signalled = asyncio.ensure_future(requested.wait())
        broken = [asyncio.ensure_future(event.wait()) for event in fatal]
        await asyncio.wait({termination, signalled, *broken}, return_when=asyncio.FIRST_COMPLETED)
        code = 1 if any(task.done() for task in broken) else 0
        if code:
            log.error("a servicer cannot go on: stopping with exit code 1")
        for task in (signalled, *broken):
            task.cancel()
        if extra_shutdown is not None:
            result = extra_shutdown()
            if asyncio.iscoroutine(result):
                await result
        await self.stop()
        termination.cancel()
        return code


def run_service(
    name: str,
    config: Any,
    server_config: ServerConfig,
    make_registrations: Callable[[], Sequence[Registration]],
) -> int:
    """Runs one gRPC service until SIGTERM/SIGINT; the body of every `rollwire <service>`.

    `config` is the whole RunConfig (for telemetry); `make_registrations` is
    called inside the event loop so servicers can create asyncio objects.
    Returns the process exit code: 0 after a clean stop, 1 if it could not start.
    """
    from rollwire.services.core.telemetry import configure_logging, configure_tracing

    configure_logging(name, config.telemetry.log_level, config.telemetry.log_format)
    provider = configure_tracing(name, config.telemetry.trace_exporter)

    async def main() -> int:
        registrations = make_registrations()
        runtime = ServiceRuntime(name, server_config, tracer_provider=provider)
        await runtime.start(registrations)

        async def close_servicers() -> None:
            for registration in registrations:
                close = getattr(registration.servicer, "close", None)
                if callable(close):
                    result = close()
                    if asyncio.iscoroutine(result):
                        await result

        fatal = [r.servicer.fatal for r in registrations if hasattr(r.servicer, "fatal")]
        return await runtime.serve_until_signalled(close_servicers, fatal)

    try:
        return asyncio.run(main())
    except (OSError, ValueError) as error:
        log.error("cannot start: %s", error)
        return 1
    finally:
        if provider is not None:
            provider.shutdown()
