"""The env registry and the env-server: its table, its error contract, sessions, plugins."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
from google.protobuf import struct_pb2

from rollwire.envs import registry
from rollwire.envs.base import Env
from rollwire.envs.games import GuessTheNumber
from rollwire.envs.server import EnvServicer, registrations
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import EnvServerConfig
from rollwire.services.core.metrics import COUNTERS


def test_registry() -> None:
    assert "guess_the_number" in {spec.env_id for spec in registry.list_specs()}
    assert isinstance(registry.make("guess_the_number", high=10), GuessTheNumber)
    with pytest.raises(
        registry.UnknownEnv, match="unknown env id 'nope'; registered: .*guess_the_number"
    ):
        registry.make("nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("guess_the_number", GuessTheNumber, "again")


def test_the_builtin_table_is_what_is_registered() -> None:
    listed = {spec.env_id for spec in registry.list_specs()}
    assert {builtin.env_id for builtin in registry._BUILTINS} <= listed
    for builtin in registry._BUILTINS:
        assert registry.demonstrator(builtin.env_id) is builtin.demonstrator
    assert {"guess_the_number", "tool_use"} <= set(registry.ids_with_demonstrator())
    assert registry.demonstrator("frozen_lake") is None
    with pytest.raises(registry.UnknownEnv, match="unknown env id 'nope'"):
        registry.demonstrator("nope")


class Exploding(Env):
    """Raises in step, to show the server survives a broken env."""

    def reset(self, seed=None):
        return "ready", {}

    def step(self, action):
        raise ZeroDivisionError("boom")


@pytest.fixture(scope="module", autouse=True)
def exploding_env():
    registry.register("test_exploding", Exploding, "raises in step")
    yield
    registry._REGISTRY.pop("test_exploding")


@pytest.fixture
async def env_stub(start_service):
    config = EnvServerConfig(max_sessions=3, max_action_bytes=32)
    runtime = await start_service(registrations(config))
    async with open_channel(runtime.address) as channel:
        yield env_pb2_grpc.EnvServiceStub(channel)


async def expect(call, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() is code, caught.value.details()
    assert text in caught.value.details()


@pytest.mark.integration
async def test_env_server_plays_an_episode(env_stub) -> None:
    stub = env_stub
    listing = await stub.ListEnvs(env_pb2.ListEnvsRequest())
    assert "guess_the_number" in [spec.env_id for spec in listing.envs]
    kwargs = struct_pb2.Struct()
    kwargs.update({"low": 1, "high": 8, "max_turns": 8})
    reset = await stub.Reset(
        env_pb2.ResetRequest(env_id="guess_the_number", seed=5, env_kwargs=kwargs)
    )
    assert "between 1 and 8" in reset.observation
    assert reset.info["high"] == 8
    for guess in range(1, 9):
        step = await stub.Step(env_pb2.StepRequest(session_id=reset.session_id, action=str(guess)))
        if step.terminated:
            break
    assert step.terminated and step.reward == 1.0 and step.observation == "correct"
    assert (await stub.Close(env_pb2.CloseRequest(session_id=reset.session_id))).existed
    assert not (await stub.Close(env_pb2.CloseRequest(session_id=reset.session_id))).existed


@pytest.mark.integration
async def test_env_server_error_contract(env_stub) -> None:
    stub = env_stub
    before = COUNTERS.get("env_rejected")
    await expect(
        stub.Reset(env_pb2.ResetRequest(env_id="chess")),
        grpc.StatusCode.NOT_FOUND,
        "unknown env id 'chess'",
    )
    bad_kwargs = struct_pb2.Struct()
    bad_kwargs.update({"colour": "red"})
    await expect(
        stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number", env_kwargs=bad_kwargs)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "cannot create 'guess_the_number'",
    )
    await expect(
        stub.Step(env_pb2.StepRequest(session_id="nope", action="1")),
        grpc.StatusCode.NOT_FOUND,
        "unknown or expired session",
    )
    session = (await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number", seed=1))).session_id
    await expect(
        stub.Step(env_pb2.StepRequest(session_id=session, action="x" * 33)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "exceeds the limit of 32",
    )
    await expect(
        stub.Step(env_pb2.StepRequest(session_id=session, action="pass")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "rejected the action",
    )
    # The session survives rejected actions and can still finish.
    for guess in range(1, 101):
        step = await stub.Step(env_pb2.StepRequest(session_id=session, action=str(guess)))
        if step.terminated or step.truncated:
            break
    await expect(
        stub.Step(env_pb2.StepRequest(session_id=session, action="5")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "episode has ended",
    )
    assert COUNTERS.get("env_rejected") == before + 6


@pytest.mark.integration
async def test_the_operator_not_the_client_decides_the_sandbox(start_service) -> None:
    """A Reset that asks a code-running env for less isolation than the env-server's
    sandbox (none instead of bubblewrap, a longer run, more memory) is refused with
    PERMISSION_DENIED and counted; the server's own choice is used otherwise; an operator
    may let clients lower it."""
    from rollwire.services.core.config import EnvSandboxConfig
    from rollwire.services.core.sandbox import bwrap_path

    def kwargs(**values) -> struct_pb2.Struct:
        struct = struct_pb2.Struct()
        struct.update({"tools": ["python"], **values})
        return struct

    strict = EnvServerConfig(sandbox=EnvSandboxConfig(kind="none", max_timeout_s=5))
    runtime = await start_service(registrations(strict))
    async with open_channel(runtime.address) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        before = COUNTERS.get("env_rejected", reason="sandbox")
        await expect(
            stub.Reset(
                env_pb2.ResetRequest(env_id="tool_use", env_kwargs=kwargs(python_timeout_s=30))
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "python_timeout_s: 30",
        )
        assert COUNTERS.get("env_rejected", reason="sandbox") == before + 1
        # Within the limits: the server's sandbox kind, without the client naming one.
        reply = await stub.Reset(env_pb2.ResetRequest(env_id="tool_use", env_kwargs=kwargs()))
        assert reply.session_id
    if bwrap_path() is not None:  # the default server runs bubblewrap: `none` is lower
        runtime = await start_service(registrations(EnvServerConfig()))
        async with open_channel(runtime.address) as channel:
            stub = env_pb2_grpc.EnvServiceStub(channel)
            await expect(
                stub.Reset(
                    env_pb2.ResetRequest(env_id="tool_use", env_kwargs=kwargs(sandbox="none"))
                ),
                grpc.StatusCode.PERMISSION_DENIED,
                "sandbox: none",
            )
    lenient = EnvSandboxConfig(kind="none", max_timeout_s=5, clients_may_lower=True)
    runtime = await start_service(registrations(EnvServerConfig(sandbox=lenient)))
    async with open_channel(runtime.address) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        reset = env_pb2.ResetRequest(env_id="tool_use", env_kwargs=kwargs(python_timeout_s=30))
        assert (await stub.Reset(reset)).session_id


@pytest.mark.integration
async def test_env_server_survives_a_crashing_env_and_enforces_session_limit(env_stub) -> None:
    stub = env_stub
    broken = (await stub.Reset(env_pb2.ResetRequest(env_id="test_exploding"))).session_id
    await expect(
        stub.Step(env_pb2.StepRequest(session_id=broken, action="a")),
        grpc.StatusCode.INTERNAL,
        "ZeroDivisionError: boom",
    )
    await expect(
        stub.Step(env_pb2.StepRequest(session_id=broken, action="a")),
        grpc.StatusCode.NOT_FOUND,
        "unknown or expired",
    )
    sessions = [
        (await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number"))).session_id
        for _ in range(3)
    ]
    await expect(
        stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number")),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "limit of 3 sessions",
    )
    await stub.Close(env_pb2.CloseRequest(session_id=sessions[0]))
    assert (await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number"))).session_id


async def test_idle_sessions_expire() -> None:
    now = [0.0]
    servicer = EnvServicer(EnvServerConfig(session_idle_seconds=10), clock=lambda: now[0])

    class Context:
        async def abort(self, code, details):
            raise grpc.aio.AbortError(details)  # stands in for the server's abort

    reply = await servicer.Reset(env_pb2.ResetRequest(env_id="guess_the_number", seed=0), Context())
    now[0] = 9.0
    await servicer.Step(env_pb2.StepRequest(session_id=reply.session_id, action="1"), Context())
    now[0] = 18.0  # 9 s after the last call: still alive
    await servicer.Step(env_pb2.StepRequest(session_id=reply.session_id, action="2"), Context())
    now[0] = 40.0
    with pytest.raises(grpc.aio.AbortError, match="unknown or expired"):
        await servicer.Step(env_pb2.StepRequest(session_id=reply.session_id, action="3"), Context())
    assert servicer.session_count == 0


def test_server_refuses_unregistered_env_ids_in_config() -> None:
    with pytest.raises(ValueError, match=r"unregistered env ids: \['chess'\]"):
        EnvServicer(EnvServerConfig(envs=["guess_the_number", "chess"]))


def test_env_plugins_are_imported_and_bad_ones_named(tmp_path, monkeypatch) -> None:
    from rollwire.envs import registry
    from rollwire.envs.host import SessionHost
    from rollwire.services.core.config import EnvServerConfig

    (tmp_path / "my_envs_plugin.py").write_text(
        "from rollwire.envs.games import GuessTheNumber\n"
        "from rollwire.envs.registry import register\n"
        "register('tiny_guess', lambda: GuessTheNumber(1, 3), 'Guess 1..3.')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        host = SessionHost(EnvServerConfig(plugins=["my_envs_plugin"]))
        assert "tiny_guess" in {spec.env_id for spec in host.specs()}
        with pytest.raises(ValueError, match="'no_such_plugin' cannot be imported"):
            SessionHost(EnvServerConfig(plugins=["no_such_plugin"]))
    finally:
        registry._REGISTRY.pop("tiny_guess", None)
