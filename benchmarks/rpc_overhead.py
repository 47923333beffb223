"""What the service runtime costs per call: EnvService.Step over gRPC on loopback.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rpc_overhead.py [--calls 4000]

Compares, in one run and one process pair of event loops:
  in-process   env.step() called directly (no gRPC)
  bare grpc    grpc.aio server and channel with no interceptors
  runtime      rollwire's ServiceRuntime + open_channel (deadlines, counters, trace propagation)
  +auth+trace  the same with a bearer token and spans recorded by an SDK tracer
at 1 call in flight and at 64 in flight. Prints µs per call and the ratio to bare grpc.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc.aio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rollwire.envs.games import GuessTheNumber
from rollwire.envs.server import registrations
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import AuthConfig, ClientConfig, EnvServerConfig, ServerConfig
from rollwire.services.core.server import ServiceRuntime
from rollwire.services.core.structs import to_struct

ENV_CONFIG = EnvServerConfig(max_sessions=100_000)


async def drive(stub: env_pb2_grpc.EnvServiceStub, calls: int, concurrency: int) -> float:
    """Seconds for `calls` Step calls spread over `concurrency` sessions (each kept alive)."""
    per_session = calls // concurrency
    # Guessing 0 is always "higher", so an episode lasts exactly max_turns steps.
    kwargs = to_struct({"max_turns": per_session + 1})
    sessions = []
    for _ in range(concurrency):
        reply = await stub.Reset(
            env_pb2.ResetRequest(env_id="guess_the_number", seed=0, env_kwargs=kwargs)
        )
        sessions.append(reply.session_id)

    async def worker(session_id: str) -> None:
        for _ in range(per_session):
            await stub.Step(env_pb2.StepRequest(session_id=session_id, action="0"))

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sessions))
    return time.perf_counter() - started


async def bare(calls: int, concurrency: int) -> float:
    server = grpc.aio.server()
    (registration,) = registrations(ENV_CONFIG)
    registration.add_to_server(registration.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await drive(env_pb2_grpc.EnvServiceStub(channel), calls, concurrency)
    finally:
        await server.stop(0)


async def runtime(calls: int, concurrency: int, secure: bool) -> float:
    provider = None
    token = AuthConfig(token="bench-token") if secure else AuthConfig()
    if secure:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    service = ServiceRuntime("bench", ServerConfig(auth=token), tracer_provider=provider)
    await service.start(registrations(ENV_CONFIG))
    try:
        async with open_channel(
            service.address, ClientConfig(auth=token), tracer_provider=provider
        ) as channel:
            return await drive(env_pb2_grpc.EnvServiceStub(channel), calls, concurrency)
    finally:
        await service.stop(0)


def in_process(calls: int) -> float:
    env = GuessTheNumber(max_turns=calls + 1)
    env.reset(0)
    started = time.perf_counter()
    for _ in range(calls):
        env.step("0")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="Step calls per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()

    def best(measure, *measure_args, **measure_kwargs) -> float:
        return min(
            asyncio.run(measure(*measure_args, **measure_kwargs)) for _ in range(args.repeats)
        )

    print(f"EnvService.Step, {args.calls} calls, best of {args.repeats}\n")
    print(f"{'setup':<14}{'in flight':>10}{'µs/call':>10}{'calls/s':>10}{'vs bare':>9}")
    direct = min(in_process(args.calls) for _ in range(args.repeats))
    print(
        f"{'in-process':<14}{1:>10}{direct / args.calls * 1e6:>10.2f}{args.calls / direct:>10.0f}{'':>9}"
    )
    for concurrency in (1, 64):
        calls = args.calls - args.calls % concurrency
        baseline = best(bare, calls, concurrency)
        rows = [
            ("bare grpc", baseline),
            ("runtime", best(runtime, calls, concurrency, secure=False)),
            ("+auth+trace", best(runtime, calls, concurrency, secure=True)),
        ]
        for name, seconds in rows:
            print(
                f"{name:<14}{concurrency:>10}{seconds / calls * 1e6:>10.1f}{calls / seconds:>10.0f}{seconds / baseline:>8.2f}x"
            )


if __name__ == "__main__":
    main()
