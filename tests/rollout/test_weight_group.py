"""Weights by broadcast in a process group of the trainer and the rollout-servers: gloo on
this CPU (the same code runs NCCL between GPUs: the `gpu` test), the fallback to gRPC
streams when a member is lost, bad requests, and a whole run with it."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.services.core.client import open_channel
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import Registration
from rollwire.trainer.process.weight_sender import GroupPublisher, publish
from tests.helpers.runs import SHORT_RUN, jsonl, rollwire_train

torch.set_num_threads(1)


class Weights:
    """Stands in for the trainer's Policy: what `publish` reads from it."""

    def __init__(self, model, seed: int, device: str = "cpu") -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tensors = {
            name: (p.detach() + 0.1 * torch.randn(p.shape, generator=generator)).to(device)
            for name, p in model.named_parameters()
        }

    def named_weights(self):
        return list(self.tensors.items())


async def start_servers(start_service, model_path, count: int, devices: tuple[str, ...] = ()):
    """`count` rollout-servers in this process, server i on devices[i] (default: the CPU)."""
    servers = []
    for index in range(count):
        device = devices[index] if devices else "cpu"
        engine = HFEngine(model_path, max_batch_size=4, device=device)
        servicer = RolloutServicer(engine)
        runtime = await start_service(
            [
                Registration(
                    rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                    servicer,
                    "rollwire.v1.RolloutService",
                )
            ]
        )
        servers.append((engine, servicer, runtime))
    return servers


def assert_serves(engine: HFEngine, weights: Weights, version: int) -> None:
    assert engine.version == version
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach().cpu(), weights.tensors[name].cpu()), name


async def broadcast_round_trip(
    start_service, model_path, backend: str, device: str, server_devices: tuple[str, str]
) -> None:
    """The trainer's side on `device`, two rollout-servers on `server_devices`."""
    servers = await start_servers(start_service, model_path, 2, server_devices)
    channels = [open_channel(runtime.address) for _, _, runtime in servers]
    stubs = [rollout_pb2_grpc.RolloutServiceStub(channel) for channel in channels]
    try:
        group = await GroupPublisher.form(stubs, "127.0.0.1", backend, 20.0, device=device)
        for version in (1, 2):
            weights = Weights(servers[0][0].model, seed=version, device=device)
            await publish(stubs, weights, version, 1 << 20, group=group)
            assert group.usable
            for engine, _, _ in servers:
                assert_serves(engine, weights, version)
        # A member lost: the broadcast fails, the group is dropped, and the server still
        # there gets the version as a gRPC stream.
        failures = COUNTERS.get("weight_group_failures")
        await servers[1][2].stop(grace=0)
        await servers[1][1].close()
        weights = Weights(servers[0][0].model, seed=3, device=device)
        await publish(stubs, weights, 3, 1 << 20, group=group)
        assert not group.usable
        assert COUNTERS.get("weight_group_failures") == failures + 1
        assert_serves(servers[0][0], weights, 3)
        weights = Weights(servers[0][0].model, seed=4, device=device)
        await publish(stubs[:1], weights, 4, 1 << 20, group=group)  # streams from now on
        assert_serves(servers[0][0], weights, 4)
    finally:
        for channel in channels:
            await channel.close()
        for _, servicer, _ in servers:
            await servicer.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_broadcast_to_two_servers_then_fall_back_to_streams(
    start_service, tiny_model_path
) -> None:
    await broadcast_round_trip(start_service, tiny_model_path, "gloo", "cpu", ("cpu", "cpu"))


@pytest.mark.gpu
@pytest.mark.timeout(300)
async def test_broadcast_over_nccl(start_service, tiny_model_path) -> None:
    """NCCL takes one device per member of a group (two on one device are refused): the
    trainer and the two servers on three GPUs."""
    if torch.cuda.device_count() < 3:
        pytest.skip(
            f"NCCL wants a GPU per member: a trainer and two rollout-servers need 3 GPUs, "
            f"this machine has {torch.cuda.device_count()}"
        )
    await broadcast_round_trip(
        start_service, tiny_model_path, "nccl", "cuda:0", ("cuda:1", "cuda:2")
    )


@pytest.mark.integration
async def test_bad_group_requests_are_refused_and_the_server_keeps_serving(
    start_service, tiny_model_path
) -> None:
    [(engine, servicer, runtime)] = await start_servers(start_service, tiny_model_path, 1)
    async with open_channel(runtime.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        bad = [
            rollout_pb2.JoinWeightGroupRequest(),
            rollout_pb2.JoinWeightGroupRequest(
                address="127.0.0.1", port=1, rank=0, world_size=2, backend="gloo", group_id="g",
                timeout_seconds=1,
            ),
            rollout_pb2.JoinWeightGroupRequest(
                address="127.0.0.1", port=1, rank=1, world_size=2, backend="mpi", group_id="g",
                timeout_seconds=1,
            ),
        ]  # fmt: skip
        for request in bad:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.JoinWeightGroup(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nobody listens on the store's port: the group does not form, within the timeout.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.JoinWeightGroup(
                rollout_pb2.JoinWeightGroupRequest(
                    address="127.0.0.1", port=free_port(), rank=1, world_size=2,
                    backend="gloo", group_id="g", timeout_seconds=1,
                ),
                timeout=30,
            )  # fmt: skip
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(version=1, group_id="g"))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
        assert status.policy_version == 0 and engine.version == 0
    await servicer.close()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_run_sends_its_weights_by_broadcast(tmp_path) -> None:
    run_dir, result = rollwire_train(tmp_path, *SHORT_RUN, "trainer.weights.transport=group")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert len(steps) == 4 and all(step["weights_by_group"] == 1.0 for step in steps)
    assert "weights received by broadcast" in (run_dir / "logs" / "rollout-server.log").read_text()
