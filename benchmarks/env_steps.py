"""Env steps per second: in-process, LocalEnvs, gRPC unary, gRPC Multiplex, and OpenEnv.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_steps.py \\
        [--steps 4000] [--repeats 3] [--peer-python /tmp/openenv/bin/python]

One trivial env (echoes the action, reward 0, never ends, empty info) is
registered here and in the servers this script starts, and nowhere else.
Every server runs in its own process and every measurement's client in
another (all with OMP_NUM_THREADS=1); each client opens its sessions, warms
up, then times `--steps` steps spread over the sessions, `--repeats` times,
and reports the best. Rows:

  SessionHost      host.step() called in a loop (no event loop, no wire): the floor
  LocalEnvs        the async in-process backend the agent loop uses
  gRPC unary       RemoteEnvs(multiplex=False): one Step RPC per step
  gRPC Multiplex   RemoteEnvs: steps batched on one bidi stream
  ... 2 servers    sessions spread over two env-server processes
  OpenEnv          the same env on openenv-core's server and its WebSocket
                   EnvClient (one connection per session); once as written
                   (sync `step`, run by the server in a per-session thread)
                   and once overriding `step_async` (run on the event loop)

OpenEnv runs under --peer-python (an interpreter with `openenv-core`
installed, e.g. `python3 -m venv /tmp/openenv && /tmp/openenv/bin/pip install
openenv-core`); without one the peer rows are skipped with the reason.
"µs over in-process" is the per-step time minus SessionHost's. Ratios compare
with OpenEnv's default path at the same number of sessions.

This file imports only the standard library at the top: the peer interpreter
runs it too, without rollwire installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV_ID = "bench_echo"
ACTION = "0"


# ---------------------------------------------------------------- the trivial env


def register_rollwire_env() -> None:
    """Registers `bench_echo` in this process's env registry."""
    from rollwire.envs import registry
    from rollwire.envs.base import Env

    class Echo(Env):
        def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "ready", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            return action, 0.0, False, False, {}

    registry.register(ENV_ID, Echo, "echoes the action (benchmark only)")


def openenv_app(use_step_async: bool) -> Any:
    """The same env as an OpenEnv FastAPI app (only importable under the peer interpreter)."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class EchoAction(Action):
        message: str

    class EchoObservation(Observation):
        echoed: str = ""

    class EchoEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
            return EchoObservation(echoed="ready", reward=0.0, done=False)

        def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any):
            return EchoObservation(echoed=action.message, reward=0.0, done=False)

        @property
        def state(self) -> State:
            return self._state

    class EchoEnvironmentAsync(EchoEnvironment):
        async def step_async(
            self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
        ):
            return self.step(action)

    env_class = EchoEnvironmentAsync if use_step_async else EchoEnvironment
    return create_app(
        env_class, EchoAction, EchoObservation, env_name=ENV_ID, max_concurrent_envs=1024
    )


# ---------------------------------------------------------------- servers (child processes)


def serve_rollwire(ready_file: str) -> int:
    register_rollwire_env()
    from rollwire.services.app.cli import main

    return main(
        [
            "env-server",
            "--port",
            "0",
            "--ready-file",
            ready_file,
            "--set",
            "env_server.max_sessions=100000",
            "--set",
            "telemetry.log_level=warning",
        ]
    )


def serve_openenv(ready_file: str, use_step_async: bool) -> int:
    import uvicorn

    app = openenv_app(use_step_async)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    # Connections made before uvicorn takes over wait in the listen backlog.
    Path(ready_file + ".tmp").write_text(f"127.0.0.1:{port}\n")
    os.replace(ready_file + ".tmp", ready_file)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    asyncio.run(server.serve(sockets=[listener]))
    return 0


# ---------------------------------------------------------------- clients (child processes)


async def _timed(
    workers: int, steps: int, repeats: int, step: Callable[[int], Any], warmup: int = 20
) -> float:
    """Best seconds for `steps` steps over `workers` concurrent sequential workers."""
    per_worker = steps // workers

    async def run(worker: int, count: int) -> None:
        for _ in range(count):
            await step(worker)

    await asyncio.gather(*(run(w, warmup) for w in range(workers)))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        await asyncio.gather(*(run(w, per_worker) for w in range(workers)))
        best = min(best, time.perf_counter() - started)
    return best


async def client_rollwire(kind: str, addresses: list[str], sessions: int, steps: int, repeats: int):
    if kind == "host":
        return host_loop(sessions, steps, repeats)
    from rollwire.envs.client import LocalEnvs, RemoteEnvs
    from rollwire.services.core.config import ClientConfig, EnvServerConfig

    if kind == "local":
        register_rollwire_env()
        backends: list[Any] = [LocalEnvs(EnvServerConfig(max_sessions=100_000))]
    else:
        config = ClientConfig(default_timeout_seconds=120)
        backends = [RemoteEnvs(a, config, multiplex=kind == "multiplex") for a in addresses]
    try:
        opened = await asyncio.gather(
            *(backends[i % len(backends)].reset(ENV_ID) for i in range(sessions))
        )
        targets = [(backends[i % len(backends)], opened[i][0]) for i in range(sessions)]

        def step(worker: int) -> Any:
            backend, session_id = targets[worker]
            return backend.step(session_id, ACTION)

        return await _timed(sessions, steps, repeats, step)
    finally:
        for backend in backends:
            await backend.aclose()


def host_loop(sessions: int, steps: int, repeats: int) -> float:
    register_rollwire_env()
    from rollwire.envs.host import SessionHost
    from rollwire.services.core.config import EnvServerConfig

    host = SessionHost(EnvServerConfig(max_sessions=100_000))
    session_ids = [host.reset(ENV_ID)[0] for _ in range(sessions)]
    order = (session_ids * (steps // sessions + 1))[: steps - steps % sessions]
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        started = time.perf_counter()
        for session_id in order:
            host.step(session_id, ACTION)
        best = min(best, time.perf_counter() - started)
    return best


async def client_openenv(address: str, sessions: int, steps: int, repeats: int) -> float:
    from openenv.core.generic_client import GenericEnvClient

    clients = [GenericEnvClient(base_url=f"http://{address}") for _ in range(sessions)]
    try:
        for client in clients:
            await client.connect()
        await asyncio.gather(*(client.reset() for client in clients))

        def step(worker: int) -> Any:
            return clients[worker].step({"message": ACTION})

        return await _timed(sessions, steps, repeats, step)
    finally:
        for client in clients:
            await client.close()


def run_client(args: argparse.Namespace) -> int:
    if args.kind == "openenv":
        seconds = asyncio.run(
            client_openenv(args.addresses[0], args.sessions, args.steps, args.repeats)
        )
    else:
        result = client_rollwire(args.kind, args.addresses, args.sessions, args.steps, args.repeats)
        seconds = asyncio.run(result)
    steps = args.steps - args.steps % args.sessions
    print(json.dumps({"seconds": seconds, "steps": steps}))
    return 0


# ---------------------------------------------------------------- the driver


class Children:
    """Processes this benchmark started, each in its own process group, killed by pid."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, python: str, *args: str) -> subprocess.Popen[str]:
        log = open(self.folder / f"child-{len(self.processes)}.log", "w")  # noqa: SIM115
        process = subprocess.Popen(
            [python, __file__, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def server(self, python: str, *args: str, timeout: float = 60.0) -> tuple[str, Any]:
        ready = self.folder / f"ready-{len(self.processes)}"
        process = self.start(python, *args, "--ready-file", str(ready))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready.exists() and ready.read_text().strip():
                return ready.read_text().strip(), process
            if process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop(process)
        raise RuntimeError(f"server {args[0]} did not start; see {self.folder}")

    @staticmethod
    def stop(process: subprocess.Popen[str]) -> None:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes:
            self.stop(process)


def measure(
    python: str, kind: str, addresses: list[str], sessions: int, args: argparse.Namespace
) -> float:
    """Steps per second of one client process."""
    command = [
        python,
        __file__,
        "_client",
        "--kind",
        kind,
        "--sessions",
        str(sessions),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        *(["--addresses", *addresses] if addresses else []),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{kind} client failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["steps"] / report["seconds"]


def peer_problem(python: str | None) -> str | None:
    """Why OpenEnv cannot be measured, or None when it can."""
    if not python:
        return "no --peer-python given"
    if not Path(python).exists():
        return f"--peer-python {python} does not exist"
    probe = subprocess.run(
        [python, "-c", "import openenv.core, uvicorn, websockets"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return f"{python} cannot import openenv-core ({lines[-1] if lines else probe.returncode})"
    return None


def drive(args: argparse.Namespace) -> int:
    rows: list[tuple[str, int, float]] = []
    here = sys.executable
    problem = peer_problem(args.peer_python)
    with tempfile.TemporaryDirectory(prefix="env-steps-") as folder:
        children = Children(Path(folder))
        try:
            for sessions in (1, 64):
                rows.append(
                    (
                        "SessionHost (in-process)",
                        sessions,
                        measure(here, "host", [], sessions, args),
                    )
                )
                rows.append(("LocalEnvs", sessions, measure(here, "local", [], sessions, args)))
            first, _ = children.server(here, "_serve-rollwire")
            for sessions in (1, 64):
                for kind, name in (("unary", "gRPC unary"), ("multiplex", "gRPC Multiplex")):
                    rows.append((name, sessions, measure(here, kind, [first], sessions, args)))
            second, _ = children.server(here, "_serve-rollwire")
            for kind, name in (("unary", "gRPC unary"), ("multiplex", "gRPC Multiplex")):
                rate = measure(here, kind, [first, second], 64, args)
                rows.append((f"{name}, 2 servers", 64, rate))
            children.stop_all()
            if problem is None:
                for variant, name in (("default", "OpenEnv"), ("step_async", "OpenEnv step_async")):
                    address, server = children.server(
                        args.peer_python, "_serve-openenv", "--variant", variant
                    )
                    for sessions in (1, 64):
                        rate = measure(args.peer_python, "openenv", [address], sessions, args)
                        rows.append((name, sessions, rate))
                    children.stop(server)
        finally:
            children.stop_all()
    print_table(rows, args, problem)
    return 0


def print_table(
    rows: list[tuple[str, int, float]], args: argparse.Namespace, problem: str | None
) -> None:
    floor = {s: r for n, s, r in rows if n.startswith("SessionHost")}
    peer = {s: r for n, s, r in rows if n == "OpenEnv"}
    print(
        f"Trivial env, {args.steps} steps per run, best of {args.repeats}; "
        f"{os.cpu_count()} CPU cores; server and client in separate processes.\n"
    )
    print("| path | sessions | steps/s | µs/step | µs over in-process | vs OpenEnv default |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, sessions, rate in rows:
        per_step = 1e6 / rate
        over = "" if name.startswith("SessionHost") else f"{per_step - 1e6 / floor[sessions]:.1f}"
        ratio = f"{rate / peer[sessions]:.2f}x" if sessions in peer else "n/a"
        print(f"| {name} | {sessions} | {rate:,.0f} | {per_step:.1f} | {over} | {ratio} |")
    if problem is not None:
        print(f"\nOpenEnv rows skipped: {problem}.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("_client", help="(internal) one measurement")
    client.add_argument("--kind", required=True)
    client.add_argument("--addresses", nargs="*", default=[])
    client.add_argument("--sessions", type=int, required=True)
    client.add_argument("--steps", type=int, required=True)
    client.add_argument("--repeats", type=int, required=True)
    rollwire_server = sub.add_parser("_serve-rollwire", help="(internal) an env-server")
    rollwire_server.add_argument("--ready-file", required=True)
    openenv_server = sub.add_parser("_serve-openenv", help="(internal) an OpenEnv server")
    openenv_server.add_argument("--ready-file", required=True)
    openenv_server.add_argument("--variant", choices=["default", "step_async"], default="default")
    parser.add_argument("--steps", type=int, default=4000, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the best counts")
    parser.add_argument(
        "--peer-python",
        default="/tmp/openenv/bin/python",
        help="interpreter with openenv-core installed (the peer rows are skipped without one)",
    )
    args = parser.parse_args()
    if args.command == "_client":
        return run_client(args)
    if args.command == "_serve-rollwire":
        return serve_rollwire(args.ready_file)
    if args.command == "_serve-openenv":
        return serve_openenv(args.ready_file, args.variant == "step_async")
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
