"""Fuzzing every decoder a peer can reach: random and mutated frames into the buffer's
two sockets and into every method of every gRPC service. Each gets an answer (a clear
error or a valid reply) within its deadline, nothing crashes, and the server goes on
serving well-formed requests afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
import zmq

from rollwire.envs.server import registrations as env_registrations
from rollwire.proto.v1 import (
    env_pb2,
    reward_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from rollwire.reward.server import registrations as reward_registrations
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.services.buffer.client import BufferProducer, BufferTrainerClient
from rollwire.services.buffer.server import BufferServer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from rollwire.services.core.client import check_health, open_channel
from rollwire.services.core.config import EnvServerConfig, RewardServerConfig
from rollwire.services.core.server import Registration
from rollwire.services.core.wire import encode
from rollwire.trainer.process.loop import TrainerServicer, TrainerState
from tests.helpers.trajectories import trajectory

pytestmark = pytest.mark.integration
ROUNDS = 60  # per method and kind of frame; fixed seeds, so a failure repeats


def mutations(rng: random.Random, valid: bytes, rounds: int) -> Iterator[bytes]:
    """Random bytes, then `valid` with bytes flipped, cut short, spliced or extended."""
    for _ in range(rounds):
        yield rng.randbytes(rng.randrange(0, 300))
    for _ in range(rounds):
        data = bytearray(valid)
        kind = rng.randrange(4)
        if kind == 0 and data:
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del data[rng.randrange(len(data) + 1) :]
        elif kind == 2 and data:
            at = rng.randrange(len(data))
            data[at:at] = rng.randbytes(rng.randrange(1, 16))
        else:
            data += rng.randbytes(rng.randrange(1, 64))
        yield bytes(data)


# ---------------------------------------------------------------- the buffer


def test_the_buffer_answers_every_random_or_mutated_message_and_keeps_serving(tmp_path) -> None:
    state = BufferState(group_size=2, max_staleness=5)
    trajectory_log = TrajectoryLog(tmp_path)
    trajectory_log.restore(state, 1 << 20)
    server = BufferServer(state, trajectory_log=trajectory_log)
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    context = zmq.Context.instance()
    rng = random.Random(20261130)
    frame = encode(trajectory("fuzz", 0))
    seq = (1).to_bytes(8, "big")
    producer_shapes = [
        lambda body: [b"put", seq, body],
        lambda body: [b"put_group", seq, body, body],
        lambda body: [b"drop", seq, body],
        lambda body: [body],
        lambda body: [b"put", body[:8], body[8:]],
    ]
    trainer_shapes = [
        lambda body: [b"get", body],
        lambda body: [b"ack", body],
        lambda body: [b"commit", body],
        lambda body: [b"resume", body],
        lambda body: [body, body],
    ]
    valid_json = json.dumps(
        {"batch_id": "x", "trajectory_ids": ["a/0"], "groups": 1, "wait_ms": 0}
    ).encode()
    answered = 0
    try:
        for endpoint, shapes, valid in (
            (server.endpoints["producer"], producer_shapes, frame),
            (server.endpoints["trainer"], trainer_shapes, valid_json),
        ):
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            try:
                for body in mutations(rng, valid, ROUNDS):
                    socket.send_multipart(rng.choice(shapes)(body))
                    assert socket.poll(5000), "the buffer did not answer"
                    reply = socket.recv_multipart()
                    assert reply[0] in (
                        b"ack",
                        b"error",
                        b"acked",
                        b"committed",
                        b"resumed",
                        b"batch",
                        b"empty",
                        b"status",
                        b"ledger",
                    ), reply[:1]
                    answered += 1
            finally:
                socket.close(0)
        assert thread.is_alive()
        # Still whole: a well-formed group goes in and comes out.
        producer = BufferProducer(server.endpoints["producer"], timeout=2)
        trainer = BufferTrainerClient(server.endpoints["trainer"], timeout=2)
        try:
            for index in range(2):
                result = asyncio.run(producer.put(trajectory("after", index)))
                assert result.accepted, result.reason
            batch = None
            for _ in range(5):  # fuzzed groups that happened to be whole may come first
                batch = trainer.get_batch(0, 1, 0.5)
                if batch is not None and batch.trajectories[0].group_id == "after":
                    break
            assert batch is not None and batch.trajectories[0].group_id == "after"
        finally:
            producer.close()
            trainer.close()
    finally:
        server.stop()
        thread.join(timeout=10)
    assert answered == 4 * ROUNDS


# ---------------------------------------------------------------- the gRPC services


# Errors a garbled request may earn. Not among them: UNKNOWN (gRPC's answer to bytes its
# deserializer rejects, which the service runtime turns into INVALID_ARGUMENT) and
# INTERNAL (an exception the servicer did not expect).
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a mutated but valid request may ask for much work
    grpc.StatusCode.UNAVAILABLE,  # e.g. the trainer's Checkpoint while it is not training
}


async def fuzz_service(
    channel: grpc.aio.Channel, module, service: str, valid: dict, timeout: float = 5.0
) -> dict:
    """Sends garbled requests to every method of `service`; returns outcomes by method."""
    rng = random.Random(service)
    descriptor = module.DESCRIPTOR.services_by_name[service]
    outcomes: dict[str, dict[str, int]] = {}
    for method in descriptor.methods:
        path = f"/{descriptor.full_name}/{method.name}"
        example = valid.get(method.name, b"")
        seen = outcomes.setdefault(method.name, {})
        for body in mutations(rng, example, ROUNDS // 3):
            try:
                if method.client_streaming and method.server_streaming:
                    call = channel.stream_stream(path)(iter([body, body]), timeout=timeout)
                    async for _ in call:
                        pass
                elif method.client_streaming:
                    await channel.stream_unary(path)(iter([body, body]), timeout=timeout)
                elif method.server_streaming:
                    async for _ in channel.unary_stream(path)(body, timeout=timeout):
                        pass
                else:
                    await channel.unary_unary(path)(body, timeout=timeout)
                outcome = "OK"
            except grpc.aio.AioRpcError as error:
                assert error.code() in CLEAR, f"{method.name}: {error.code()} {error.details()}"
                assert error.details(), f"{method.name}: {error.code()} without a message"
                outcome = error.code().name
            seen[outcome] = seen.get(outcome, 0) + 1
    return outcomes


async def serve_and_fuzz(
    start_service, registrations, module, service, valid, timeout: float = 5.0
) -> dict:
    runtime = await start_service(registrations)
    async with open_channel(runtime.address) as channel:
        outcomes = await fuzz_service(channel, module, service, valid, timeout)
        assert await check_health(channel) == "SERVING"
    return outcomes


async def test_env_server_decoders(start_service) -> None:
    valid = {
        "Reset": env_pb2.ResetRequest(env_id="guess_the_number", seed=1).SerializeToString(),
        "Step": env_pb2.StepRequest(session_id="s", action="50").SerializeToString(),
        "Close": env_pb2.CloseRequest(session_id="s").SerializeToString(),
    }
    registrations = env_registrations(EnvServerConfig())
    outcomes = await serve_and_fuzz(start_service, registrations, env_pb2, "EnvService", valid)
    assert set(outcomes) >= {"Reset", "Step", "Close", "ListEnvs", "Multiplex"}
    servicer = registrations[0].servicer
    session, *_ = await servicer.host.reset_async("guess_the_number", 3)
    assert servicer.host.close(session)  # the host still works


async def test_reward_server_decoders(start_service) -> None:
    item = reward_pb2.ScoreItem(item_id="1", domain="format", response="<answer>1</answer>")
    valid = {"Score": reward_pb2.ScoreRequest(items=[item]).SerializeToString()}
    registrations = reward_registrations(RewardServerConfig(workers=1, item_timeout_seconds=2))
    try:
        outcomes = await serve_and_fuzz(
            start_service, registrations, reward_pb2, "RewardService", valid
        )
    finally:
        await registrations[0].servicer.close()
    assert "Score" in outcomes


async def test_trainer_service_decoders(start_service) -> None:
    registration = Registration(
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
        TrainerServicer(TrainerState()),
        "rollwire.v1.TrainerService",
    )
    # Checkpoint waits for the next training step, which never comes here: short deadlines.
    outcomes = await serve_and_fuzz(
        start_service, [registration], trainer_pb2, "TrainerService", {}, timeout=0.3
    )
    assert set(outcomes) == {"GetStatus", "GetVersion", "Checkpoint", "FetchWeights"}


async def test_rollout_server_decoders(start_service, tiny_model_path) -> None:
    engine = HFEngine(tiny_model_path, max_batch_size=8)
    servicer = RolloutServicer(engine)
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=2)
    valid = {
        "Generate": rollout_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling
        ).SerializeToString(),
        "GenerateGroup": rollout_pb2.GenerateGroupRequest(
            request_id="g", prompt_token_ids=[1, 2], sampling=sampling, num_samples=2
        ).SerializeToString(),
        "Abort": rollout_pb2.AbortRequest(request_ids=["r"]).SerializeToString(),
        "UpdateWeights": rollout_pb2.WeightChunk(
            version=1, name="model.embed_tokens.weight", data=b"\0" * 8
        ).SerializeToString(),
    }
    registration = Registration(
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
        servicer,
        "rollwire.v1.RolloutService",
    )
    try:
        outcomes = await serve_and_fuzz(
            start_service, [registration], rollout_pb2, "RolloutService", valid
        )
        assert engine.version == 0, "garbled chunks changed the weights"
        result = await engine.generate("after", [1, 2, 3], SamplingSpec(max_new_tokens=2))
        assert len(result.token_ids) == 2
    finally:
        await servicer.close()
    assert {"Generate", "GenerateGroup", "UpdateWeights"} <= set(outcomes)
