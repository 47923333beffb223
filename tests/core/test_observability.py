"""What operators reach for: gRPC server reflection on every server, and the Prometheus
`/metrics` endpoint of counters and gauges (checked with prometheus-client's own parser)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from rollwire.envs.server import registrations as env_registrations
from rollwire.proto.v1 import env_pb2, env_pb2_grpc, rollout_pb2_grpc
from rollwire.reward.server import registrations as reward_registrations
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import EnvServerConfig, RewardServerConfig, ServerConfig
from rollwire.services.core.server import Registration
from tests.conftest import ROLLWIRE

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


async def listed_services(address: str) -> list[str]:
    """The services a server names through reflection, as grpcurl's `list` asks."""
    async with open_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for reply in stub.ServerReflectionInfo(ask(), timeout=10):
            return sorted(s.name for s in reply.list_services_response.service)
    raise AssertionError("no reflection reply")


async def described_file(address: str, symbol: str) -> str:
    """The name of the file descriptor reflection gives for `symbol`."""
    from google.protobuf import descriptor_pb2

    async with open_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)

        async for reply in stub.ServerReflectionInfo(ask(), timeout=10):
            (raw, *_) = reply.file_descriptor_response.file_descriptor_proto
            return descriptor_pb2.FileDescriptorProto.FromString(raw).name
    raise AssertionError("no reflection reply")


@pytest.mark.integration
async def test_every_kind_of_server_lists_its_services_through_reflection(
    start_service, tiny_model_path
) -> None:
    engine = HFEngine(tiny_model_path, max_batch_size=2)
    servers = {
        "rollwire.v1.EnvService": env_registrations(EnvServerConfig()),
        "rollwire.v1.RewardService": reward_registrations(RewardServerConfig(workers=1)),
        "rollwire.v1.RolloutService": [
            Registration(
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                RolloutServicer(engine),
                "rollwire.v1.RolloutService",
            )
        ],
    }
    try:
        for service, registrations in servers.items():
            runtime = await start_service(registrations)
            assert await listed_services(runtime.address) == sorted([service, HEALTH, REFLECTION])
            # A client can fetch the schema it needs to call the service.
            assert await described_file(runtime.address, service) == (
                f"rollwire/proto/v1/{service.split('.')[-1].removesuffix('Service').lower()}.proto"
            )
    finally:
        await servers["rollwire.v1.RewardService"][0].servicer.close()
        await engine.close()


@pytest.mark.integration
async def test_reflection_can_be_switched_off(start_service) -> None:
    runtime = await start_service(
        env_registrations(EnvServerConfig()), ServerConfig(reflection=False, grace_seconds=0)
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await listed_services(runtime.address)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def scrape(url: str) -> dict:
    """{metric name: [(labels, value)]} from the endpoint, through Prometheus' parser."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


@pytest.mark.integration
async def test_a_servers_counters_and_gauges_are_scraped_from_its_metrics_endpoint(
    start_service, tmp_path
) -> None:
    ready = tmp_path / "env.ready"
    runtime = await start_service(
        env_registrations(EnvServerConfig()),
        ServerConfig(metrics_port=0, ready_file=ready, grace_seconds=0),
    )
    url = (tmp_path / "env.ready.metrics").read_text().strip()
    assert url == runtime.metrics.url and url.endswith("/metrics")

    def resets(metrics: dict) -> float:
        return sum(
            value
            for labels, value in metrics.get("rollwire_rpc_calls", [])
            if labels["method"] == "/rollwire.v1.EnvService/Reset"
        )

    def not_found(metrics: dict) -> float:
        return sum(
            value
            for labels, value in metrics.get("rollwire_rpc_errors", [])
            if labels.get("code") == "NOT_FOUND"
        )

    before = await asyncio.to_thread(scrape, url)  # counters are the process's: earlier tests
    async with open_channel(runtime.address) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        for seed in range(3):
            await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number", seed=seed))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Reset(env_pb2.ResetRequest(env_id="no_such_env"))
    metrics = await asyncio.to_thread(scrape, url)
    assert metrics["rollwire_env_open_sessions"] == [({}, 3.0)]
    assert resets(metrics) == resets(before) + 4
    assert not_found(metrics) == not_found(before) + 1
    await runtime.stop(grace=0)
    assert not (tmp_path / "env.ready.metrics").exists()


@pytest.mark.integration
def test_the_buffer_serves_its_status_as_metrics(spawn, tmp_path) -> None:
    ready = tmp_path / "buffer.ready"
    child = spawn(
        [
            *ROLLWIRE,
            "buffer",
            "--set",
            f"buffer.ready_file={ready}",
            "--set",
            "buffer.metrics_port=0",
            "--set",
            f"run.output_dir={tmp_path / 'run'}",
        ]
    )
    json.loads(child.wait_for_file(ready, timeout=60))
    url = child.wait_for_file(tmp_path / "buffer.ready.metrics", timeout=10)
    metrics = scrape(url)
    fields = {labels["field"]: value for labels, value in metrics["rollwire_buffer"]}
    assert fields["ready_groups"] == 0.0 and fields["trainer_version"] == 0.0
    assert {"accepted", "partial_groups", "frontier"} <= fields.keys()
    code, _, err = child.terminate()
    assert code == 0, err
