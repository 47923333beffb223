"""The service runtime over real gRPC on loopback: health, ready file, auth,
tracing, deadlines, limits, error shaping, TLS."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from rollwire.proto.v1 import trainer_pb2, trainer_pb2_grpc
from rollwire.services.core.client import check_health, open_channel, wait_for_serving
from rollwire.services.core.config import AuthConfig, ClientConfig, ServerConfig, TLSConfig
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import Registration, ServiceRuntime

pytestmark = pytest.mark.integration
SERVICE = "rollwire.v1.TrainerService"


class FakeTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """GetVersion answers, GetStatus crashes, Checkpoint is slow, so each runtime path is reachable."""

    def __init__(self) -> None:
        self.version = 7

    async def GetVersion(self, request, context):
        return trainer_pb2.VersionResponse(policy_version=self.version)

    async def GetStatus(self, request, context):
        raise RuntimeError("status table is corrupt")

    async def Checkpoint(self, request, context):
        await asyncio.sleep(3)
        return trainer_pb2.CheckpointResponse(path="/ckpt", step=1)


def trainer_registration() -> Registration:
    return Registration(
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server, FakeTrainer(), SERVICE
    )


async def test_health_serving_ready_file_and_not_serving_on_stop(start_service, tmp_path) -> None:
    ready = tmp_path / "sub" / "ready"
    runtime = await start_service(
        [trainer_registration()], ServerConfig(ready_file=ready, grace_seconds=1)
    )
    assert ready.read_text().strip() == runtime.address
    assert runtime.address.startswith("127.0.0.1:") and not runtime.address.endswith(":0")
    async with open_channel(runtime.address) as channel:
        await wait_for_serving(channel, timeout=5)
        assert await check_health(channel, SERVICE) == "SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check_health(channel, "no.such.Service")
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND

        # While a slow call drains, health already says NOT_SERVING.
        slow = asyncio.ensure_future(
            trainer_pb2_grpc.TrainerServiceStub(channel).Checkpoint(trainer_pb2.CheckpointRequest())
        )
        await asyncio.sleep(0.2)
        stopping = asyncio.ensure_future(runtime.stop(grace=1))
        await asyncio.sleep(0.1)
        assert runtime.health._server_status[""] == 2  # NOT_SERVING
        await stopping
        with pytest.raises(grpc.aio.AioRpcError):
            await slow  # cancelled when the grace period ran out
    assert not ready.exists()


async def test_unexpected_exception_becomes_internal_and_server_keeps_serving(
    start_service,
) -> None:
    runtime = await start_service([trainer_registration()])
    before = COUNTERS.get("rpc_internal_errors")
    async with open_channel(runtime.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetStatus(trainer_pb2.TrainerStatusRequest())
        assert caught.value.code() is grpc.StatusCode.INTERNAL
        assert "RuntimeError: status table is corrupt" in caught.value.details()
        assert (await stub.GetVersion(trainer_pb2.VersionRequest())).policy_version == 7
    assert COUNTERS.get("rpc_internal_errors") == before + 1
    assert COUNTERS.get("rpc_errors", method=f"/{SERVICE}/GetStatus", code="INTERNAL") >= 1


async def test_client_default_deadline_applies(start_service) -> None:
    runtime = await start_service([trainer_registration()])
    async with open_channel(runtime.address, ClientConfig(default_timeout_seconds=0.3)) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Checkpoint(trainer_pb2.CheckpointRequest())
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started < 2.5  # far below the servicer's 3 s sleep
        # An explicit timeout still wins over the default.
        reply = await stub.GetVersion(trainer_pb2.VersionRequest(), timeout=5)
        assert reply.policy_version == 7


async def test_bearer_token(start_service) -> None:
    server = ServerConfig(auth=AuthConfig(token="s3cret"))
    runtime = await start_service([trainer_registration()], server)
    request = trainer_pb2.VersionRequest()
    async with open_channel(runtime.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetVersion(request)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in caught.value.details()
        # Health stays reachable without the token (probes do not carry secrets).
        assert await check_health(channel) == "SERVING"
    async with open_channel(
        runtime.address, ClientConfig(auth=AuthConfig(token="wrong"))
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(request)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "wrong bearer token" in caught.value.details()
    async with open_channel(
        runtime.address, ClientConfig(auth=AuthConfig(token="s3cret"))
    ) as channel:
        assert (
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(request)
        ).policy_version == 7


async def test_token_also_guards_health_when_not_exempt(start_service) -> None:
    server = ServerConfig(auth=AuthConfig(token="s3cret", exempt_health=False))
    runtime = await start_service([trainer_registration()], server)
    async with open_channel(runtime.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check_health(channel)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_client_and_server_spans_share_one_trace(start_service, tracing) -> None:
    provider, exporter = tracing
    runtime = await start_service([trainer_registration()], tracer_provider=provider)
    async with open_channel(runtime.address, tracer_provider=provider) as channel:
        await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(trainer_pb2.VersionRequest())
    for _ in range(50):  # the client span ends in a task once the call completes
        spans = [s for s in exporter.get_finished_spans() if s.name.endswith("GetVersion")]
        if len(spans) == 2:
            break
        await asyncio.sleep(0.02)
    kinds = {span.kind.name: span for span in spans}
    assert set(kinds) == {"CLIENT", "SERVER"}
    client, server = kinds["CLIENT"], kinds["SERVER"]
    assert client.context.trace_id == server.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.attributes["rpc.grpc.status_code"] == 0


async def test_server_span_records_errors(start_service, tracing) -> None:
    provider, exporter = tracing
    runtime = await start_service([trainer_registration()], tracer_provider=provider)
    async with open_channel(runtime.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(
                trainer_pb2.TrainerStatusRequest()
            )
    (span,) = [s for s in exporter.get_finished_spans() if s.name.endswith("GetStatus")]
    assert span.status.status_code.name == "ERROR"
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]


async def test_message_size_limit(start_service) -> None:
    runtime = await start_service([trainer_registration()], ServerConfig(max_message_bytes=4096))
    async with open_channel(runtime.address) as channel:
        health_stub = __import__("grpc_health.v1.health_pb2_grpc", fromlist=["x"]).HealthStub(
            channel
        )
        from grpc_health.v1 import health_pb2

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_stub.Check(health_pb2.HealthCheckRequest(service="x" * 10_000))
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await check_health(channel) == "SERVING"


async def test_wait_for_serving_times_out_with_a_clear_message() -> None:
    async with open_channel("127.0.0.1:1") as channel:  # nothing listens on port 1
        with pytest.raises(
            TimeoutError,
            match=r"127.0.0.1:1 did not report SERVING .* within 0.5s; last: UNAVAILABLE",
        ):
            await wait_for_serving(channel, timeout=0.5, target="127.0.0.1:1")


async def test_binding_a_taken_port_is_a_clear_error(start_service) -> None:
    first = await start_service([trainer_registration()])
    port = int(first.address.rsplit(":", 1)[1])
    second = ServiceRuntime("second", ServerConfig(port=port))
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
        await second.start([trainer_registration()])


async def test_tls_and_mutual_tls(start_service, certificates) -> None:
    certs = certificates
    server_tls = TLSConfig(
        cert_file=certs / "server.pem", key_file=certs / "server.key", ca_file=certs / "ca.pem"
    )
    runtime = await start_service([trainer_registration()], ServerConfig(tls=server_tls))
    request = trainer_pb2.VersionRequest()
    with_client_cert = ClientConfig(
        tls=TLSConfig(
            ca_file=certs / "ca.pem", cert_file=certs / "client.pem", key_file=certs / "client.key"
        )
    )
    async with open_channel(runtime.address, with_client_cert) as channel:
        assert (
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(request)
        ).policy_version == 7
    # Trusting the CA but presenting no certificate: the mTLS handshake fails.
    no_client_cert = ClientConfig(
        default_timeout_seconds=3, tls=TLSConfig(ca_file=certs / "ca.pem")
    )
    async with open_channel(runtime.address, no_client_cert) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(request)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    # Plaintext against a TLS server fails too.
    async with open_channel(runtime.address, ClientConfig(default_timeout_seconds=3)) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetVersion(request)


async def test_a_server_restarted_on_its_old_port_is_reached_at_once(start_service) -> None:
    """A failed connection's back-off belongs to the channel that met it, not to every channel."""
    import socket

    with socket.socket() as placeholder:  # a port nothing listens on, yet
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    dead = open_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check_health(dead, timeout=2)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        runtime = await start_service([trainer_registration()], ServerConfig(port=port))
        fresh = open_channel(runtime.address)
        try:
            assert await check_health(fresh, timeout=5) == "SERVING"
        finally:
            await fresh.close()
    finally:
        await dead.close()


async def test_a_fatal_servicer_stops_the_service_with_exit_code_one() -> None:
    """A servicer that can no longer serve (its engine broke) sets its `fatal` event: the
    service stops and returns 1, so a supervisor (the launcher) starts it again."""
    runtime = ServiceRuntime("test", ServerConfig(grace_seconds=0.5))
    await runtime.start([trainer_registration()])
    fatal = asyncio.Event()
    serving = asyncio.ensure_future(runtime.serve_until_signalled(fatal=[fatal]))
    await asyncio.sleep(0.1)
    assert not serving.done()
    fatal.set()
    assert await asyncio.wait_for(serving, 10) == 1


async def test_a_rollout_server_whose_engine_broke_is_fatal(tiny_model_path) -> None:
    from rollwire.proto.v1 import rollout_pb2
    from rollwire.rollout.server.hf_engine import HFEngine
    from rollwire.rollout.server.servicer import RolloutServicer

    engine = HFEngine(tiny_model_path, max_batch_size=2)
    servicer = RolloutServicer(engine)

    async def broken(*args, **kwargs):
        engine.failure = RuntimeError("the device went away")
        raise RuntimeError(f"the engine is shutting down ({engine.failure})")

    engine.generate = broken

    class Context:
        async def abort(self, code, details):
            raise grpc.aio.AbortError(details)

        def time_remaining(self):
            return 10.0

        def set_trailing_metadata(self, metadata):
            pass

    with pytest.raises(grpc.aio.AbortError, match="device went away"):
        await servicer.Generate(
            rollout_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2]), Context()
        )
    assert servicer.fatal.is_set()
    await servicer.close()
