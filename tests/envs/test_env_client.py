"""The env client: LocalEnvs and RemoteEnvs behave alike; Multiplex batching, ordering,
fallback to unary calls, blocking envs, bad frames and lost servers."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from rollwire.envs import registry
from rollwire.envs.base import Env, InvalidAction, Observation
from rollwire.envs.client import EnvBackend, EnvCallError, EnvServerLost, LocalEnvs, RemoteEnvs
from rollwire.envs.host import SessionHost
from rollwire.envs.server import EnvServicer, registrations
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import ClientConfig, EnvServerConfig
from rollwire.services.core.metrics import COUNTERS

CONFIG = EnvServerConfig(max_sessions=4, max_action_bytes=32)
CLIENT = ClientConfig(default_timeout_seconds=10)
BACKENDS = ["local", "multiplex", "unary"]


class Crashing(Env):
    """Raises in step, to show a broken env only costs its own session."""

    def reset(self, seed=None):
        return "ready", {"ratio": 0.5, "whole": 3.0, "nested": {"items": [1, 2.5, "x"]}}

    def step(self, action):
        raise ZeroDivisionError("boom")


class Gated(Env):
    """A blocking env: the action "wait" holds its step until the test opens the gate."""

    blocking = True
    started = threading.Event()
    gate = threading.Event()

    def reset(self, seed=None):
        self.turn = 0
        return "ready", {}

    def step(self, action):
        if action == "wait":
            Gated.started.set()
            if not Gated.gate.wait(timeout=30):
                raise TimeoutError("the test never opened the gate")
        if action == "bad":
            raise InvalidAction("not this one")
        self.turn += 1
        return f"turn {self.turn}", float(self.turn), False, False, {}


@pytest.fixture(scope="module", autouse=True)
def test_envs():
    registry.register("client_test_crashing", Crashing, "raises in step")
    registry.register("client_test_gated", Gated, "blocking; waits for the test")
    yield
    registry._REGISTRY.pop("client_test_crashing")
    registry._REGISTRY.pop("client_test_gated")


@pytest.fixture(autouse=True)
def closed_gate():
    Gated.started.clear()
    Gated.gate.clear()
    yield
    Gated.gate.set()  # never leave a pool thread waiting


async def make_backend(kind: str, start_service, config: EnvServerConfig = CONFIG, **client):
    if kind == "local":
        return LocalEnvs(config)
    runtime = await start_service(registrations(config))
    return RemoteEnvs(
        runtime.address, ClientConfig(**{"default_timeout_seconds": 10, **client}), kind != "unary"
    )


@pytest.fixture(params=BACKENDS)
async def backend(request, start_service) -> AsyncIterator[EnvBackend]:
    envs = await make_backend(request.param, start_service)
    yield envs
    await envs.aclose()


async def outcome(call) -> Any:
    """The result of an awaited call, or ("error", code, message)."""
    try:
        return await call
    except EnvCallError as error:
        return ("error", error.code, error.message)


async def transcript(envs: EnvBackend) -> list[Any]:
    """Every kind of call and refusal, with session ids replaced by their order of creation."""
    names: dict[str, str] = {}

    def name(session_id: str) -> str:
        return names.setdefault(session_id, f"s{len(names)}")

    seen: list[Any] = [[spec.env_id for spec in await envs.list_envs()]]
    seen.append(await outcome(envs.reset("chess")))
    seen.append(await outcome(envs.reset("guess_the_number", kwargs={"colour": "red"})))
    seen.append(await outcome(envs.step("nope", "1")))
    session, observation, info = await envs.reset(
        "guess_the_number", seed=1, kwargs={"low": 1, "high": 8, "max_turns": 3}
    )
    seen.append((name(session), observation, info))
    seen.append(await outcome(envs.step(session, "x" * 33)))
    seen.append(await outcome(envs.step(session, "pass")))
    for guess in (0, 0, 0, 0):  # three turns, then the episode is over
        seen.append(await outcome(envs.step(session, str(guess))))
    crashing, observation, info = await envs.reset("client_test_crashing")
    seen.append((name(crashing), observation, info))
    seen.append(await outcome(envs.step(crashing, "a")))
    seen.append(await outcome(envs.step(crashing, "a")))
    others = [(await envs.reset("guess_the_number"))[0] for _ in range(3)]
    seen.append(await outcome(envs.reset("guess_the_number")))
    seen.append(await envs.close(others[0]))
    seen.append(await envs.close(others[0]))
    seen.append(await envs.close(session))
    for other in others[1:]:
        await envs.close(other)
    # An observation that shows a picture: the same bytes through every backend.
    lock, observation, info = await envs.reset("digit_lock", seed=3, kwargs={"dials": 2})
    seen.append((name(lock), observation, info))
    wrong = (int(info["reference"]) + 1) % 10
    seen.append(await outcome(envs.step(lock, f"it is {wrong}")))
    await envs.close(lock)

    def masked(entry: Any) -> Any:
        if isinstance(entry, tuple) and entry[0] == "error":
            message = entry[2]
            for session_id, label in names.items():
                message = message.replace(session_id, label)
            return (*entry[:2], message)
        return entry

    return [masked(entry) for entry in seen]


@pytest.mark.integration
async def test_local_and_remote_backends_are_indistinguishable(start_service) -> None:
    transcripts = {}
    for kind in BACKENDS:
        envs = await make_backend(kind, start_service)
        try:
            transcripts[kind] = await transcript(envs)
        finally:
            await envs.aclose()
    local = transcripts["local"]
    assert transcripts["multiplex"] == local
    assert transcripts["unary"] == local
    # The contract itself, spelled out once.
    codes = [entry[1] for entry in local if isinstance(entry, tuple) and entry[0] == "error"]
    assert codes == [
        "NOT_FOUND",  # unknown env id
        "INVALID_ARGUMENT",  # bad kwargs
        "NOT_FOUND",  # unknown session
        "RESOURCE_EXHAUSTED",  # action too large
        "INVALID_ARGUMENT",  # rejected action
        "FAILED_PRECONDITION",  # step after the episode ended
        "INTERNAL",  # the env crashed
        "NOT_FOUND",  # ... and its session is gone
        "RESOURCE_EXHAUSTED",  # session limit
    ]
    assert local[1][2].startswith("unknown env id 'chess'; this server offers:")
    assert "ZeroDivisionError: boom; the session is closed" in local[12][2]
    # Info crosses the wire as JSON-like data: integral floats come back as ints.
    assert local[11][2] == {"ratio": 0.5, "whole": 3, "nested": {"items": [1, 2.5, "x"]}}
    assert local[-5:-2] == [True, False, True]
    (_, first, _), (again, reward, *_) = local[-2:]
    assert isinstance(first, Observation) and first.text == "dial 1/2?"
    (picture,) = first.images
    assert picture.format == "png" and picture.data.startswith(b"\x89PNG")
    assert again == Observation("no. dial 1/2?", (picture,)) and reward == 0.0


async def test_backends_satisfy_the_protocol(backend) -> None:
    assert isinstance(backend, EnvBackend)
    assert backend.address == "local" or ":" in backend.address


@pytest.mark.integration
async def test_multiplex_plays_200_sessions_at_once(start_service) -> None:
    config = EnvServerConfig(max_sessions=300)
    runtime = await start_service(registrations(config))
    envs = RemoteEnvs(runtime.address, CLIENT)
    unary_steps = COUNTERS.get("rpc_calls", method="/rollwire.v1.EnvService/Step")

    async def play(seed: int) -> tuple[float, int]:
        session, _, info = await envs.reset("guess_the_number", seed=seed, kwargs={"max_turns": 7})
        low, high = info["low"], info["high"]
        for turn in range(1, 8):
            guess = (low + high) // 2
            hint, reward, terminated, _, step_info = await envs.step(session, str(guess))
            assert step_info == {"guess": guess, "turn": turn}
            if terminated:
                assert await envs.close(session)
                return reward, turn
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        raise AssertionError(f"seed {seed}: binary search did not finish in 7 guesses")

    try:
        results = await asyncio.wait_for(asyncio.gather(*(play(s) for s in range(200))), 60)
        assert envs.multiplexing
    finally:
        await envs.aclose()
    assert all(reward == 1.0 for reward, _ in results)
    # Every step went over the stream, none as a unary call.
    assert COUNTERS.get("rpc_calls", method="/rollwire.v1.EnvService/Step") == unary_steps


@pytest.mark.integration
async def test_falls_back_to_unary_calls_when_the_server_has_no_multiplex() -> None:
    servicer = EnvServicer(EnvServerConfig(max_sessions=50))
    unary = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(env_pb2, f"{request}Request").FromString,
            response_serializer=getattr(env_pb2, f"{request}Response").SerializeToString,
        )
        for name, request in (
            ("ListEnvs", "ListEnvs"),
            ("Reset", "Reset"),
            ("Step", "Step"),
            ("Close", "Close"),
        )
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("rollwire.v1.EnvService", unary),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    envs = RemoteEnvs(f"127.0.0.1:{port}", CLIENT)
    try:
        assert envs.multiplexing
        # These all go out on the stream before UNIMPLEMENTED comes back; none is lost.
        opened = await asyncio.wait_for(
            asyncio.gather(*(envs.reset("guess_the_number", seed=s) for s in range(10))), 20
        )
        assert not envs.multiplexing
        assert len({session for session, _, _ in opened}) == 10
        hint, *_ = await envs.step(opened[0][0], "50")
        assert hint in ("higher", "lower", "correct")
        with pytest.raises(EnvCallError) as caught:
            await envs.step("nope", "1")
        assert caught.value.code == "NOT_FOUND"
        assert await envs.close(opened[0][0])
    finally:
        await envs.aclose()
        await server.stop(0)


async def wait_until(event: threading.Event, timeout: float = 10.0) -> None:
    if not await asyncio.to_thread(event.wait, timeout):
        raise AssertionError(f"not set within {timeout}s")


@pytest.mark.integration
@pytest.mark.parametrize("kind", BACKENDS)
async def test_a_blocking_env_does_not_stall_other_sessions(kind, start_service) -> None:
    envs = await make_backend(kind, start_service, EnvServerConfig(max_sessions=10))
    try:
        slow, _, _ = await envs.reset("client_test_gated")
        fast, _, _ = await envs.reset("guess_the_number", kwargs={"max_turns": 100})
        waiting = asyncio.ensure_future(envs.step(slow, "wait"))
        then = asyncio.ensure_future(envs.step(slow, "next"))  # must run after "wait"
        await wait_until(Gated.started)
        for _ in range(20):
            await asyncio.wait_for(envs.step(fast, "0"), 10)
        assert not waiting.done() and not then.done()
        Gated.gate.set()
        first, second = await asyncio.wait_for(asyncio.gather(waiting, then), 10)
        assert (first[0], second[0]) == ("turn 1", "turn 2")
        with pytest.raises(EnvCallError) as caught:
            await envs.step(slow, "bad")
        assert caught.value.code == "INVALID_ARGUMENT"
        assert await envs.close(slow)
    finally:
        await envs.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["multiplex", "unary"])
async def test_a_call_that_outlives_its_timeout_fails_with_deadline_exceeded(
    kind, start_service
) -> None:
    envs = await make_backend(kind, start_service, default_timeout_seconds=0.5)
    try:
        slow, _, _ = await envs.reset("client_test_gated")
        with pytest.raises(EnvCallError) as caught:
            await asyncio.wait_for(envs.step(slow, "wait"), 10)
        assert caught.value.code == "DEADLINE_EXCEEDED"
        Gated.gate.set()
        # The client still works afterwards.
        session, _, _ = await asyncio.wait_for(envs.reset("guess_the_number"), 10)
        assert await envs.close(session)
    finally:
        await envs.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("multiplex", [True, False], ids=["multiplex", "unary"])
async def test_an_unreachable_server_fails_fast_with_server_lost(multiplex) -> None:
    with socket.socket() as placeholder:  # a port nothing listens on while the test runs
        placeholder.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{placeholder.getsockname()[1]}"
        envs = RemoteEnvs(address, ClientConfig(default_timeout_seconds=60), multiplex=multiplex)
        try:
            for _ in range(2):  # and again: a new stream, the same answer
                with pytest.raises(EnvServerLost) as caught:
                    await asyncio.wait_for(envs.reset("guess_the_number"), 15)
                assert caught.value.code == "UNAVAILABLE" and address in caught.value.message
        finally:
            await envs.aclose()


@pytest.mark.integration
async def test_old_streams_retire_without_losing_calls(start_service, monkeypatch) -> None:
    monkeypatch.setattr("rollwire.envs.client.STREAM_ROTATE_SECONDS", 0.0)
    runtime = await start_service(registrations(EnvServerConfig(max_sessions=20)))
    envs = RemoteEnvs(runtime.address, CLIENT)
    try:
        sessions = [
            s
            for s, _, _ in await asyncio.gather(
                *(envs.reset("client_test_gated") for _ in range(8))
            )
        ]
        for _ in range(5):  # every round opens a new stream and retires the last
            results = await asyncio.wait_for(
                asyncio.gather(*(envs.step(session, "go") for session in sessions)), 10
            )
            assert len(results) == 8
        assert (await envs.step(sessions[0], "go"))[0] == "turn 6"
        assert len(envs._streams) <= 3  # retired streams end once answered
    finally:
        await envs.aclose()


@pytest.mark.integration
async def test_multiplex_answers_bad_frames_and_keeps_serving(start_service) -> None:
    runtime = await start_service(registrations(CONFIG))
    rejected = COUNTERS.get("env_rejected", reason="empty_call")
    duplicates = COUNTERS.get("env_rejected", reason="duplicate_call_id")
    async with open_channel(runtime.address, CLIENT) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        call = stub.Multiplex()

        async def exchange(*calls: env_pb2.EnvCall, expect: int) -> list[env_pb2.EnvReply]:
            await call.write(env_pb2.EnvCallBatch(calls=list(calls)))
            replies: list[env_pb2.EnvReply] = []
            while len(replies) < expect:
                batch = await asyncio.wait_for(call.read(), 10)
                assert batch is not grpc.aio.EOF, "the server ended the stream"
                replies.extend(batch.replies)
            return replies

        await call.write(env_pb2.EnvCallBatch())  # an empty frame is allowed and ignored
        replies = await exchange(
            env_pb2.EnvCall(call_id=1),
            env_pb2.EnvCall(call_id=2, step=env_pb2.StepRequest(session_id="nope", action="1")),
            env_pb2.EnvCall(call_id=3, reset=env_pb2.ResetRequest(env_id="guess_the_number")),
            env_pb2.EnvCall(call_id=3, close=env_pb2.CloseRequest(session_id="whatever")),
            env_pb2.EnvCall(call_id=4, reset=env_pb2.ResetRequest(env_id="chess")),
            expect=5,
        )
        by_id: dict[int, list[env_pb2.EnvReply]] = {}
        for reply in replies:
            by_id.setdefault(reply.call_id, []).append(reply)
        assert by_id[1][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "carries no reset, step or close" in by_id[1][0].error.message
        assert by_id[2][0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert by_id[4][0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        kinds = sorted(reply.WhichOneof("reply") for reply in by_id[3])
        assert kinds == ["error", "reset"]
        duplicate = next(r for r in by_id[3] if r.WhichOneof("reply") == "error")
        assert "already in flight" in duplicate.error.message
        session = next(r for r in by_id[3] if r.WhichOneof("reply") == "reset").reset.session_id

        # The stream carries on, and id 3 may be used again now that it was answered.
        (step,) = await exchange(
            env_pb2.EnvCall(call_id=3, step=env_pb2.StepRequest(session_id=session, action="50")),
            expect=1,
        )
        assert step.step.observation in ("higher", "lower", "correct")
        (closed,) = await exchange(
            env_pb2.EnvCall(call_id=5, close=env_pb2.CloseRequest(session_id=session)), expect=1
        )
        assert closed.WhichOneof("reply") == "close" and closed.close.existed
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK
        # And unary calls are still served.
        listing = await stub.ListEnvs(env_pb2.ListEnvsRequest())
        assert "guess_the_number" in [spec.env_id for spec in listing.envs]
    assert COUNTERS.get("env_rejected", reason="empty_call") == rejected + 1
    assert COUNTERS.get("env_rejected", reason="duplicate_call_id") == duplicates + 1


@pytest.mark.integration
async def test_a_shutting_down_server_ends_streams_and_clients_fail_fast(start_service) -> None:
    (registration,) = registrations(CONFIG)
    runtime = await start_service([registration])
    servicer: EnvServicer = registration.servicer
    envs = RemoteEnvs(runtime.address, CLIENT)
    try:
        session, _, _ = await envs.reset("client_test_gated")
        waiting = asyncio.ensure_future(envs.step(session, "wait"))
        await wait_until(Gated.started)
        closing = asyncio.ensure_future(servicer.close())
        await asyncio.sleep(0)
        Gated.gate.set()
        # The call the stream had taken is still answered before the stream ends.
        assert (await asyncio.wait_for(waiting, 10))[0] == "turn 1"
        await asyncio.wait_for(closing, 10)
        with pytest.raises(EnvServerLost) as caught:
            await asyncio.wait_for(envs.reset("guess_the_number"), 10)
        assert caught.value.code == "UNAVAILABLE"
        # Usually the server's own words ("shutting down"); when its refusal races the
        # client's first write, gRPC reports INTERNAL instead. Either way: lost, by name.
        assert runtime.address in caught.value.message
    finally:
        await envs.aclose()


@pytest.mark.multiproc
@pytest.mark.parametrize("multiplex", [True, False], ids=["multiplex", "unary"])
async def test_a_killed_server_fails_calls_in_flight_with_server_lost(
    multiplex, spawn, tmp_path: Path
) -> None:
    ready, marker = tmp_path / "ready", tmp_path / "stepping"
    child = spawn([sys.executable, "-c", KILLABLE_SERVER, str(ready), str(marker)])
    address = await asyncio.to_thread(child.wait_for_file, ready)
    # A deadline far beyond the waits below: the failure must come from the break.
    envs = RemoteEnvs(address, ClientConfig(default_timeout_seconds=60), multiplex=multiplex)
    try:
        session, _, _ = await envs.reset("stuck")
        other, _, _ = await envs.reset("stuck")
        in_flight = asyncio.ensure_future(envs.step(session, "go"))
        also = asyncio.ensure_future(envs.step(other, "go"))
        for _ in range(500):
            if marker.exists():
                break
            await asyncio.sleep(0.02)
        assert marker.exists(), "the server never started the step"
        await asyncio.to_thread(child.kill)
        for call in (in_flight, also):
            with pytest.raises(EnvServerLost) as caught:
                await asyncio.wait_for(call, 15)
            assert caught.value.code == "UNAVAILABLE"
            assert address in caught.value.message
        # The server stays gone: a new call fails fast the same way, never hangs.
        with pytest.raises(EnvServerLost):
            await asyncio.wait_for(envs.step(session, "go"), 15)
    finally:
        await envs.aclose()


KILLABLE_SERVER = """
import pathlib, sys, time
from rollwire.envs import registry
from rollwire.envs.base import Env

class Stuck(Env):
    blocking = True
    def reset(self, seed=None):
        return "ready", {}
    def step(self, action):
        pathlib.Path(sys.argv[2]).write_text("stepping")
        time.sleep(120)
        return "late", 0.0, False, False, {}

registry.register("stuck", Stuck, "sleeps in step")
from rollwire.services.app.cli import main
sys.exit(main(["env-server", "--port", "0", "--ready-file", sys.argv[1],
               "--set", "telemetry.log_level=warning"]))
"""


# ---------------------------------------------------------------- SessionHost on its own


def test_host_raises_call_errors_with_grpc_code_names() -> None:
    host = SessionHost(CONFIG)
    with pytest.raises(EnvCallError) as caught:
        host.reset("chess")
    assert (caught.value.code, str(caught.value)) == (
        "NOT_FOUND",
        f"NOT_FOUND: {caught.value.message}",
    )
    session, observation, info = host.reset("guess_the_number", seed=0, kwargs={"high": 5})
    assert "between 1 and 5" in observation and info["high"] == 5
    assert host.step(session, "3")[0] in ("higher", "lower", "correct")
    assert host.close(session) and not host.close(session)
    assert [spec.env_id for spec in host.specs()] == sorted(s.env_id for s in host.specs())


def test_host_never_expires_a_session_while_its_call_runs() -> None:
    now = [0.0]
    host = SessionHost(EnvServerConfig(session_idle_seconds=10), clock=lambda: now[0])
    busy, _, _ = host.reset("client_test_gated")
    idle, _, _ = host.reset("guess_the_number")
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(host.step(busy, "wait")))
    worker.start()
    try:
        assert Gated.started.wait(10), "the step never started"
        now[0] = 100.0  # both sessions are past the idle limit
        host.reset("guess_the_number")  # sweeps
        assert host.session_count == 2  # the idle one went, the busy one stayed
        with pytest.raises(EnvCallError, match="unknown or expired"):
            host.step(idle, "1")
    finally:
        Gated.gate.set()
        worker.join(10)
    assert result and result[0][0] == "turn 1"
    host.close_all()
    assert host.session_count == 0


async def test_host_counts_a_pending_blocking_reset_against_the_limit() -> None:
    class SlowReset(Env):
        blocking = True

        def reset(self, seed=None):
            Gated.started.set()
            Gated.gate.wait(30)
            return "ready", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    registry.register("client_test_slow_reset", SlowReset, "blocks in reset")
    host = SessionHost(EnvServerConfig(max_sessions=1))
    try:
        first = asyncio.ensure_future(host.reset_async("client_test_slow_reset"))
        await wait_until(Gated.started)
        with pytest.raises(EnvCallError) as caught:
            await host.reset_async("guess_the_number")
        assert caught.value.code == "RESOURCE_EXHAUSTED"
        Gated.gate.set()
        session, _, _ = await asyncio.wait_for(first, 10)
        assert host.session_count == 1 and host.close(session)
    finally:
        registry._REGISTRY.pop("client_test_slow_reset")
        host.close_all()


@pytest.mark.integration
async def test_streams_carry_the_token_too(start_service) -> None:
    """grpc.aio files a channel interceptor under one call type only; streams need their own."""
    from rollwire.services.core.config import AuthConfig, ServerConfig

    runtime = await start_service(
        registrations(CONFIG), ServerConfig(auth=AuthConfig(token="s3cret"))
    )
    envs = RemoteEnvs(runtime.address, ClientConfig(auth=AuthConfig(token="s3cret")))
    try:
        session, _, _ = await envs.reset("guess_the_number", seed=1)
        await envs.step(session, "50")
        assert envs.multiplexing, "the stream was refused and the client fell back to unary"
    finally:
        await envs.aclose()
    refused = RemoteEnvs(runtime.address, ClientConfig(auth=AuthConfig(token="wrong")))
    try:
        with pytest.raises(EnvCallError, match="wrong bearer token"):
            await refused.reset("guess_the_number", seed=1)
    finally:
        await refused.aclose()
