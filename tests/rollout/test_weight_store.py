"""The trainer's weight store (`trainer.weights.store`) and a rollout-server fetching from
it (`rollout_server.weights_from`): the newest version whole, checksummed, equal to what
the trainer published; another version NOT_FOUND; bytes that do not match refused."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
import torch

from rollwire.proto.v1 import trainer_pb2, trainer_pb2_grpc
from rollwire.rollout.server.fetch import fetch_newest
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import ClientConfig
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import Registration
from rollwire.trainer.process.servicer import TrainerServicer, TrainerState
from rollwire.trainer.process.weight_store import WeightStore
from tests.rollout.test_weight_deltas import Policy, assert_serves

torch.set_num_threads(1)


async def _fetch_code(stub, version: int) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refusal:
        async for _ in stub.FetchWeights(trainer_pb2.FetchWeightsRequest(version=version)):
            pass
    return refusal.value.code()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_rollout_server_fetches_the_trainers_newest_version(
    start_service, tiny_model_path
) -> None:
    state = TrainerState()
    trainer = await start_service(
        [
            Registration(
                trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                TrainerServicer(state),
                "rollwire.v1.TrainerService",
            )
        ]
    )
    channel = open_channel(trainer.address)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    engine = HFEngine(tiny_model_path, max_batch_size=4)
    policy = Policy(engine.model)
    server = None
    try:
        assert await _fetch_code(stub, 0) == grpc.StatusCode.FAILED_PRECONDITION  # no store
        state.store = WeightStore(1 << 16)
        assert await _fetch_code(stub, 0) == grpc.StatusCode.UNAVAILABLE  # nothing yet
        for version in (1, 2, 3):  # the store keeps the newest only
            policy.step()
            state.store.put(policy.named_weights(), version, copy=True)
            state.version = version
        assert await _fetch_code(stub, 2) == grpc.StatusCode.NOT_FOUND

        # A server started with weights_from holds its requests until it serves version 3.
        server = RolloutServicer(engine, weights_from=trainer.address, fetch_seconds=30)
        assert not server._has_weights.is_set()
        await server.fetching
        assert server._has_weights.is_set()
        assert_serves(engine, policy, 3)
        assert server.weights.kept_version == 3  # the base of the next delta
        policy.step()  # the trainer moves on; the server's copy does not

        # Bytes that do not match their checksum are refused and change nothing.
        state.store.put(policy.named_weights(), 4, copy=True)
        state.version = 4
        version, _ = await state.store.chunks(4)  # encodes, then spoil the encoding
        state.store._encoded[1][0].sha256 = bytes(32)
        failures = COUNTERS.get("rollout_weight_fetch_failures")
        assert not await fetch_newest(server.weights, trainer.address, ClientConfig(), 2.5)
        assert COUNTERS.get("rollout_weight_fetch_failures") >= failures + 2
        assert engine.version == 3
        state.store._encoded = None  # encoded again, whole
        assert await fetch_newest(server.weights, trainer.address, ClientConfig(), 10)
        assert_serves(engine, policy, 4)
        # At the trainer's version already: nothing is fetched.
        fetches = COUNTERS.get("trainer_weight_fetches")
        assert await fetch_newest(server.weights, trainer.address, ClientConfig(), 10)
        assert COUNTERS.get("trainer_weight_fetches") == fetches
    finally:
        await channel.close()
        if server is not None:
            await server.close()
        else:
            await engine.close()


async def test_a_trainer_that_never_answers_leaves_the_server_its_weights() -> None:
    """A run starting (or a trainer restarting): the server serves what it has meanwhile."""

    class Receiver:
        class engine:  # what fetch_newest reads of a receiver
            version = 0

    # A port nothing listens on (bound, then closed).
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    released = []
    assert not await fetch_newest(
        Receiver(), f"127.0.0.1:{port}", ClientConfig(), 2.5, lambda: released.append(1)
    )
    # Requests were let go at the first try that met no trainer, once; the tries went on.
    assert released == [1]
