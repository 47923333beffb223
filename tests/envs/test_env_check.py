"""`rollwire env-check`: passes against good servers in two languages, names the
broken checks of a faulty one, and exits 0/1/2."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2

from rollwire.envs.check import CHECKS, CheckOptions, CheckReport, ServerUnreachable, run_checks
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import check_health, open_channel
from rollwire.services.core.server import Registration
from rollwire.services.core.structs import from_struct, to_struct

REPO = Path(__file__).resolve().parents[2]
ROLLWIRE = [sys.executable, "-m", "rollwire.services.app.cli"]
NODE_ENV = REPO / "examples" / "node-env"
SERVICE_NAME = "rollwire.v1.EnvService"
LAST_INTEGER = re.compile(r"-?\d+")


def outcomes(report: CheckReport, outcome: str) -> set[str]:
    return {result.name for result in report.results if result.outcome == outcome}


# ------------------------------------------------------------ a toy server with switchable faults


@dataclass(frozen=True)
class Faults:
    """Each field breaks one part of the contract; all off is a conforming server."""

    step_after_done_ok: bool = False
    unknown_env_code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND
    unknown_session_code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND
    close_unknown_existed: bool = False
    ignore_seed: bool = False
    nondeterministic: bool = False
    no_size_limit: bool = False
    state_slots: int | None = None  # sessions share state once more than this many are open
    multiplex: str = "ok"  # "ok", "unimplemented", "abort_on_error", "duplicate"
    picture: str = "png"  # each observation's picture: "png", "none", "broken" (not an image)
    tools: str = "ok"  # "ok" (offers `hop`), "none", "refuse" (a bad call is refused)


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ToyEnvServicer(env_pb2_grpc.EnvServiceServicer):
    """`walk`: start at seed % 7, add the last integer of each action, done after 3 moves."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.sessions: dict[str, dict[str, Any]] = {}
        self.slots: dict[int, dict[str, int]] = {}
        self.resets = 0

    def reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
        if request.env_id != "walk":
            raise Refused(self.faults.unknown_env_code, f"unknown env id {request.env_id!r}")
        kwargs = from_struct(request.env_kwargs) if request.HasField("env_kwargs") else {}
        if set(kwargs) - {"step_size"}:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown kwargs {sorted(kwargs)}")
        self.resets += 1
        seed = request.seed if request.HasField("seed") else self.resets
        if self.faults.ignore_seed:
            seed = 0
        if self.faults.nondeterministic:
            seed = self.resets
        slots = self.faults.state_slots
        slot = self.resets if slots is None else self.resets % slots
        self.slots[slot] = {"position": seed % 7, "moves": 0}
        session_id = f"s{self.resets}"
        self.sessions[session_id] = {"slot": slot, "done": False}
        return env_pb2.ResetResponse(
            session_id=session_id,
            observation=f"at {seed % 7}",
            info=to_struct({"goal": 10, **self.offered()}),
            images=self.picture(seed % 7),
        )

    def step(self, request: env_pb2.StepRequest) -> env_pb2.StepResponse:
        session = self.sessions.get(request.session_id)
        if session is None:
            raise Refused(self.faults.unknown_session_code, "unknown session")
        if not self.faults.no_size_limit and len(request.action.encode()) > 4096:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "action over 4096 bytes")
        if session["done"] and not self.faults.step_after_done_ok:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "episode over")
        if "<tool_call>" in request.action:  # `hop` is offered, but every call is an error
            if self.faults.tools == "refuse":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "bad tool call")
            return env_pb2.StepResponse(
                observation="error: call hop with its steps",
                info=to_struct({"observation_role": "tool"}),
                images=self.picture(self.slots[session["slot"]]["position"]),
            )
        numbers = LAST_INTEGER.findall(request.action)
        if not numbers:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "no integer in the action")
        state = self.slots[session["slot"]]
        state["position"] += int(numbers[-1])
        state["moves"] += 1
        session["done"] = state["moves"] >= 3
        return env_pb2.StepResponse(
            observation=f"at {state['position']}",
            reward=float(state["position"] == 10),
            terminated=session["done"],
            info=to_struct({"moves": state["moves"]}),
            images=self.picture(state["position"]),
        )

    def offered(self) -> dict[str, str]:
        if self.faults.tools == "none":
            return {}
        hop = {"name": "hop", "parameters": {"type": "object", "properties": {"steps": {}}}}
        return {"tools": json.dumps([{"type": "function", "function": hop}])}

    def picture(self, position: int) -> list[env_pb2.Image]:
        """The walker's position drawn as a 4x1 strip, one grey level per step."""
        if self.faults.picture == "none":
            return []
        if self.faults.picture == "broken":
            return [env_pb2.Image(data=b"\x89PNG but not really", format="png")]
        from PIL import Image

        from rollwire.services.core.images import encode_png

        strip = Image.new("L", (4, 1), color=(position * 20) % 256)
        return [env_pb2.Image(data=encode_png(strip).data, format="png")]

    def close(self, request: env_pb2.CloseRequest) -> env_pb2.CloseResponse:
        existed = self.sessions.pop(request.session_id, None) is not None
        return env_pb2.CloseResponse(existed=existed or self.faults.close_unknown_existed)

    async def _unary(self, method: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return method(request)
        except Refused as refusal:
            await context.abort(refusal.code, str(refusal))

    async def ListEnvs(self, request, context):
        spec = env_pb2.EnvSpec(env_id="walk", description="a walk", domain="game")
        return env_pb2.ListEnvsResponse(envs=[spec])

    async def Reset(self, request, context):
        return await self._unary(self.reset, request, context)

    async def Step(self, request, context):
        return await self._unary(self.step, request, context)

    async def Close(self, request, context):
        return await self._unary(self.close, request, context)

    async def Multiplex(self, request_iterator, context):
        if self.faults.multiplex == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Multiplex here")
        async for batch in request_iterator:
            replies = [self._answer(call) for call in batch.calls]
            errors = [reply for reply in replies if reply.HasField("error")]
            if errors and self.faults.multiplex == "abort_on_error":
                await context.abort(grpc.StatusCode(errors[0].error.code), errors[0].error.message)
            if self.faults.multiplex == "duplicate":
                replies.append(replies[0])
            yield env_pb2.EnvReplyBatch(replies=replies)

    def _answer(self, call: env_pb2.EnvCall) -> env_pb2.EnvReply:
        kind = call.WhichOneof("call")
        methods = {"reset": self.reset, "step": self.step, "close": self.close}
        try:
            if kind is None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty call")
            reply = methods[kind](getattr(call, kind))
        except Refused as refusal:
            error = env_pb2.CallError(code=refusal.code.value[0], message=str(refusal))
            return env_pb2.EnvReply(call_id=call.call_id, error=error)
        return env_pb2.EnvReply(call_id=call.call_id, **{kind: reply})


@pytest.fixture
def toy_server(start_service):
    """Starts the toy server with the given faults; returns its runtime."""

    async def start(faults: Faults = Faults()):
        servicer = ToyEnvServicer(faults)
        return await start_service(
            [Registration(env_pb2_grpc.add_EnvServiceServicer_to_server, servicer, SERVICE_NAME)]
        )

    return start


FAST = CheckOptions(timeout=10.0, sessions=16)


@pytest.mark.integration
async def test_a_conforming_toy_server_passes_every_check(toy_server) -> None:
    runtime = await toy_server()
    report = await run_checks(runtime.address, FAST)
    assert report.passed, report.results
    assert outcomes(report, "pass") == {name for name, _ in CHECKS}
    assert report.env_id == "walk"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("faults", "failed", "not_passed"),
    [
        (Faults(step_after_done_ok=True), {"step_contract"}, set()),
        (
            Faults(unknown_env_code=grpc.StatusCode.INVALID_ARGUMENT),
            {"unknown_env", "multiplex"},
            set(),
        ),
        (
            Faults(unknown_session_code=grpc.StatusCode.INTERNAL),
            {"unknown_session", "step_contract", "multiplex"},
            set(),
        ),
        (
            Faults(close_unknown_existed=True),
            {"close_unknown", "step_contract", "multiplex"},
            set(),
        ),
        (Faults(no_size_limit=True), {"oversized_action"}, set()),
        (Faults(state_slots=8), {"concurrent_sessions"}, set()),
        (
            Faults(nondeterministic=True),
            {"reset_determinism"},
            {"seed_variation", "concurrent_sessions"},
        ),
        (Faults(ignore_seed=True), set(), {"seed_variation"}),
        (Faults(multiplex="unimplemented"), set(), {"multiplex"}),
        (Faults(multiplex="abort_on_error"), {"multiplex"}, set()),
        (Faults(multiplex="duplicate"), {"multiplex"}, set()),
        (Faults(picture="broken"), {"image_observations"}, set()),
        (Faults(picture="none"), set(), {"image_observations"}),
        (Faults(tools="refuse"), {"tool_calls"}, set()),
        (Faults(tools="none"), set(), {"tool_calls"}),
    ],
    ids=[
        "step-after-done-ok",
        "unknown-env-invalid-argument",
        "unknown-session-internal",
        "close-unknown-existed",
        "no-size-limit",
        "eight-state-slots",
        "nondeterministic",
        "seed-ignored",
        "no-multiplex",
        "multiplex-aborts-on-error",
        "multiplex-answers-twice",
        "picture-not-an-image",
        "no-pictures",
        "tool-call-refused",
        "no-tools",
    ],
)
async def test_a_faulty_server_fails_exactly_the_checks_it_breaks(
    toy_server, faults: Faults, failed: set[str], not_passed: set[str]
) -> None:
    """`failed` must fail and nothing else may; `not_passed` are warned or skipped."""
    runtime = await toy_server(faults)
    report = await run_checks(runtime.address, FAST)
    details = {r.name: f"{r.outcome}: {r.detail}" for r in report.results}
    assert outcomes(report, "fail") == failed, details
    assert outcomes(report, "warn") | outcomes(report, "skip") == not_passed, details
    assert report.passed == (not failed)


@pytest.mark.integration
async def test_the_report_explains_what_broke(toy_server) -> None:
    runtime = await toy_server(Faults(step_after_done_ok=True, multiplex="unimplemented"))
    report = await run_checks(runtime.address, FAST)
    step = report.result("step_contract")
    assert "Step after the episode terminated" in step.detail
    assert "expected FAILED_PRECONDITION, got OK" in step.detail
    assert report.result("multiplex").detail.startswith("Multiplex is UNIMPLEMENTED")
    assert report.to_dict()["passed"] is False


@pytest.mark.integration
async def test_a_server_that_is_not_serving_fails_health(toy_server) -> None:
    runtime = await toy_server()
    await runtime.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    report = await run_checks(runtime.address, FAST)
    assert outcomes(report, "fail") == {"health", "still_serving"}
    assert "reports NOT_SERVING" in report.result("health").detail


@pytest.mark.integration
async def test_actions_the_env_never_accepts_skip_what_needs_a_step(toy_server) -> None:
    runtime = await toy_server()
    report = await run_checks(runtime.address, CheckOptions(actions=("left", "right")))
    assert report.passed
    assert "pass --action" in report.result("step_contract").detail
    assert report.result("step_contract").outcome == "skip"


@pytest.mark.integration
async def test_kwargs_the_env_refuses_fail_once_and_skip_the_rest(toy_server) -> None:
    runtime = await toy_server()
    good = await run_checks(runtime.address, CheckOptions(env_kwargs={"step_size": 2}, sessions=4))
    assert good.passed and not outcomes(good, "skip")
    report = await run_checks(runtime.address, CheckOptions(env_kwargs={"colour": 1}, sessions=4))
    assert outcomes(report, "fail") == {"reset_determinism"}
    assert "pass --env-kwargs" in report.result("reset_determinism").detail
    assert outcomes(report, "skip") == {
        "seed_variation",
        "step_contract",
        "oversized_action",
        "image_observations",
        "tool_calls",
        "concurrent_sessions",
        "multiplex",
    }


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port that is bound but not listening: connecting is refused, and no one else can take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.integration
async def test_an_unreachable_server_raises(refused_port: int) -> None:
    with pytest.raises(ServerUnreachable, match=f"cannot connect to 127.0.0.1:{refused_port}"):
        await run_checks(f"127.0.0.1:{refused_port}", CheckOptions(timeout=0.5))


# ------------------------------------------------------------ the CLI as a process


async def run_env_check(*args: str, timeout: float = 90) -> tuple[int, str, str]:
    """`rollwire env-check ARGS` as a child process, without blocking this event loop."""
    process = await asyncio.create_subprocess_exec(
        *ROLLWIRE,
        "env-check",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.multiproc
async def test_cli_exits_1_and_prints_the_table_for_a_faulty_server(toy_server) -> None:
    runtime = await toy_server(Faults(no_size_limit=True))
    code, out, err = await run_env_check(runtime.address, "--sessions", "8")
    assert code == 1, err
    lines = out.splitlines()
    assert lines[0].split() == ["check", "result", "detail", "ms"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert rows["oversized_action"] == "FAIL" and rows["health"] == "PASS"
    assert lines[-1].endswith("FAILED: 14 pass, 1 fail")


@pytest.mark.multiproc
async def test_cli_exits_2_when_nothing_answers(refused_port: int) -> None:
    address = f"127.0.0.1:{refused_port}"
    code, out, err = await run_env_check(address, "--timeout", "0.5", "--json")
    assert code == 2
    assert json.loads(out) == {
        "address": address,
        "reachable": False,
        "error": f"cannot connect to {address} within 0.5s",
    }
    assert f"rollwire env-check: cannot connect to {address}" in err


@pytest.mark.multiproc
async def test_cli_rejects_bad_arguments_with_2() -> None:
    code, _, err = await run_env_check("127.0.0.1:1", "--env-kwargs", "[1]")
    assert code == 2 and "--env-kwargs must be a JSON object" in err
    code, _, err = await run_env_check("127.0.0.1:1", "--timeout", "0")
    assert code == 2 and "must be positive" in err


@pytest.mark.multiproc
def test_env_check_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\nfrom rollwire.services.app.cli import main\n"
        "try:\n    main(['env-check', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('heavy:', sorted(m for m in ('torch', 'grpc', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "--action" in out.stdout and "INVALID_ARGUMENT" in out.stdout
    assert out.stdout.strip().endswith("heavy: []")


def json_outcomes(out: str) -> dict[str, str]:
    return {result["name"]: result["outcome"] for result in json.loads(out)["results"]}


@pytest.mark.multiproc
async def test_cli_passes_against_the_python_env_server(spawn, tmp_path) -> None:
    ready = tmp_path / "ready"
    child = spawn([*ROLLWIRE, "env-server", "--port", "0", "--ready-file", str(ready)])
    address = await asyncio.to_thread(child.wait_for_file, ready)
    # Pinned: the server offers more envs than this one, and the first listed may change.
    # digit_lock shows a picture with every observation, so images cross the real wire.
    code, out, err = await run_env_check(address, "--json", "--env-id", "digit_lock")
    assert code == 0, out + err
    results = json_outcomes(out)
    # digit_lock offers no tools (the mcp envs' checks are in tests/envs/test_mcp.py).
    not_passed = {name for name, outcome in results.items() if outcome != "pass"}
    assert not_passed - {"multiplex"} == {"tool_calls"} and results["tool_calls"] == "skip"
    assert results["step_contract"] == results["concurrent_sessions"] == "pass"
    assert results["image_observations"] == "pass"
    assert (await asyncio.to_thread(child.terminate))[0] == 0


@pytest.mark.multiproc
async def test_cli_sends_the_token_a_server_requires(spawn, tmp_path) -> None:
    ready = tmp_path / "ready"
    token = ["--set", "env_server.server.auth.token=s3cret"]
    child = spawn([*ROLLWIRE, "env-server", "--port", "0", "--ready-file", str(ready), *token])
    address = await asyncio.to_thread(child.wait_for_file, ready)
    pinned = ["--sessions", "4", "--env-id", "guess_the_number"]
    without, out, _ = await run_env_check(address, *pinned)
    assert without == 1 and "UNAUTHENTICATED" in out
    with_token, out, err = await run_env_check(address, *pinned, "--token", "s3cret")
    assert with_token == 0, out + err
    assert (await asyncio.to_thread(child.terminate))[0] == 0


# ------------------------------------------------------------ the Node.js env server


def node_unavailable() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (CI installs it; examples/node-env needs Node.js >= 18)"
    if not (NODE_ENV / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return "examples/node-env/node_modules is missing: run `bash deploy/install.sh` (the README's install command)"
    return None


needs_node = pytest.mark.skipif(node_unavailable() is not None, reason=str(node_unavailable()))
NODE_THREADS = {"UV_THREADPOOL_SIZE": "1"}


@pytest.fixture
async def node_server(spawn, tmp_path) -> AsyncIterator:
    """Starts examples/node-env/server.js with extra flags; yields (child, address, ready file)."""

    async def start(*flags: str):
        ready = tmp_path / f"node-{len(flags)}.addr"
        child = spawn(
            [
                "node",
                str(NODE_ENV / "server.js"),
                "--port",
                "0",
                "--ready-file",
                str(ready),
                *flags,
            ],
            env=NODE_THREADS,
        )
        return child, await asyncio.to_thread(child.wait_for_file, ready), ready

    yield start


@needs_node
@pytest.mark.multiproc
async def test_cli_passes_every_check_against_the_node_server(node_server) -> None:
    child, address, ready = await node_server()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    code, out, err = await run_env_check(address, "--json")
    assert code == 0, out + err
    outcomes = json_outcomes(out)
    # A text game: no picture to open, no tools to call.
    assert {name for name, outcome in outcomes.items() if outcome != "pass"} == {
        "image_observations",
        "tool_calls",
    }, out
    assert outcomes["image_observations"] == outcomes["tool_calls"] == "skip"
    exit_code, _, log = await asyncio.to_thread(child.terminate)
    assert exit_code == 0, log
    assert not ready.exists(), "the ready file should be removed on a clean stop"
    events = [json.loads(line)["msg"] for line in log.splitlines()]
    assert events == ["serving", "stopping", "stopped"]


async def expect_code(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() is code, caught.value.details()
    return caught.value.details()


@needs_node
@pytest.mark.multiproc
async def test_node_server_limits_kwargs_expiry_and_garbage(node_server) -> None:
    child, address, ready = await node_server("--max-sessions", "2", "--session-idle-seconds", "2")
    async with open_channel(address) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        kwargs = to_struct({"low": 1, "high": 8, "max_turns": 8})
        reset = await stub.Reset(
            env_pb2.ResetRequest(env_id="guess_the_number", seed=5, env_kwargs=kwargs)
        )
        assert reset.observation == (
            "I am thinking of an integer between 1 and 8. You have 8 guesses. "
            "Answer with a single number."
        )
        assert from_struct(reset.info) == {"low": 1, "high": 8, "max_turns": 8}
        for bad in ({"low": 1.5}, {"low": 5, "high": 1}, {"max_turns": 0}, {"colour": 1}):
            request = env_pb2.ResetRequest(env_id="guess_the_number", env_kwargs=to_struct(bad))
            await expect_code(stub.Reset(request), grpc.StatusCode.INVALID_ARGUMENT)
        await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number"))
        full = await expect_code(
            stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert "limit of 2 sessions" in full
        # Idle sessions expire: Reset succeeds again once they have (polled, bounded).
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            try:
                await stub.Reset(env_pb2.ResetRequest(env_id="guess_the_number"), timeout=5)
                break
            except grpc.aio.AioRpcError as error:
                assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert asyncio.get_running_loop().time() < deadline, "sessions never expired"
                await asyncio.sleep(0.2)
        step = env_pb2.StepRequest(session_id=reset.session_id, action="4")
        await expect_code(stub.Step(step), grpc.StatusCode.NOT_FOUND)
        # Bytes that are no StepRequest at all get an error, not a crash.
        garbage = channel.unary_unary(f"/{SERVICE_NAME}/Step")
        with pytest.raises(grpc.aio.AioRpcError):
            await garbage(b"\xff\xff\xff", timeout=5)
        assert await check_health(channel, SERVICE_NAME) == "SERVING"
    child.process.send_signal(signal.SIGINT)
    _, log = await asyncio.to_thread(child.process.communicate, timeout=15)
    assert child.process.returncode == 0, log
    assert not ready.exists()
