"""Generation throughput: Hugging Face generate() in-process vs rollwire's engine, in-process and
behind the rollout-server over gRPC.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_throughput.py [--model PATH]

Each row generates `batch` sequences of `--tokens` new tokens (no stop token)
from the same model with one torch thread, and reports tokens/s, the engine's
ratio to HF generate() at the same batch size, and the rollout-server's ratio to
the same engine in-process (what the gRPC service costs), asked two ways: one
`Generate` call per sequence, and `GenerateGroup` calls of `--group` samples of a
prompt (what the orchestrator sends).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.services.core.tiny import ensure_tiny_model

PROMPT = [20, 24, 3, 14, 3, 23, 22, 3, 32]  # "15 + 43 =" in the tiny tokenizer


def hf_generate(model, batch: int, tokens: int) -> float:
    ids = torch.tensor([PROMPT] * batch)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return batch * tokens / (time.perf_counter() - started)


async def engine_generate(engine: HFEngine, batch: int, tokens: int) -> float:
    spec = SamplingSpec(max_new_tokens=tokens)
    started = time.perf_counter()
    await asyncio.gather(*(engine.generate(uuid.uuid4().hex, PROMPT, spec) for _ in range(batch)))
    return batch * tokens / (time.perf_counter() - started)


async def server_generate(stub, batch: int, tokens: int) -> float:
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=tokens)
    started = time.perf_counter()
    await asyncio.gather(
        *(
            stub.Generate(
                rollout_pb2.GenerateRequest(
                    request_id=uuid.uuid4().hex, prompt_token_ids=PROMPT, sampling=sampling
                )
            )
            for _ in range(batch)
        )
    )
    return batch * tokens / (time.perf_counter() - started)


async def server_generate_groups(stub, batch: int, tokens: int, group: int) -> float:
    """`batch` sequences as GenerateGroup calls of `group` samples (the orchestrator's way)."""
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=tokens)
    samples, calls = min(group, batch), max(1, batch // group)
    started = time.perf_counter()
    await asyncio.gather(
        *(
            stub.GenerateGroup(
                rollout_pb2.GenerateGroupRequest(
                    request_id=uuid.uuid4().hex,
                    prompt_token_ids=PROMPT,
                    sampling=sampling,
                    num_samples=samples,
                )
            )
            for _ in range(calls)
        )
    )
    return calls * samples * tokens / (time.perf_counter() - started)


def best(values: list[float]) -> float:
    return max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="Hugging Face model folder (default: the built-in tiny model)"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--group", type=int, default=8, help="samples per GenerateGroup call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        model_path = Path(args.model) if args.model else ensure_tiny_model(Path(scratch) / "tiny")
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        ready = Path(scratch) / "ready"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollwire.services.app.cli",
                "rollout-server",
                "--port",
                "0",
                "--ready-file",
                str(ready),
                "--set",
                f"rollout_server.model_path={model_path}",
                "--set",
                f"rollout_server.max_batch_size={max(args.batches)}",
                "--set",
                "telemetry.log_level=warning",
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            address = ready.read_text().strip()

            async def measure() -> list[tuple[int, float, float, float]]:
                # The server's own batching settings: only the gRPC service differs.
                engine = HFEngine(model_path, max_batch_size=max(args.batches))
                await engine.start()
                rows = []
                async with open_channel(address) as channel:
                    await wait_for_serving(channel, timeout=60, target=address)
                    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                    for batch in args.batches:
                        hf = best(
                            [hf_generate(model, batch, args.tokens) for _ in range(args.repeats)]
                        )
                        local = best(
                            [
                                await engine_generate(engine, batch, args.tokens)
                                for _ in range(args.repeats)
                            ]
                        )
                        remote = best(
                            [
                                await server_generate(stub, batch, args.tokens)
                                for _ in range(args.repeats)
                            ]
                        )
                        grouped = best(
                            [
                                await server_generate_groups(stub, batch, args.tokens, args.group)
                                for _ in range(args.repeats)
                            ]
                        )
                        rows.append((batch, hf, local, remote, grouped))
                await engine.close()
                return rows

            rows = asyncio.run(measure())
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(
        f"{args.tokens} new tokens per sequence, 1 torch thread, tokens/s (best of {args.repeats})"
    )
    print(
        f"{'batch':>6}{'HF generate':>14}{'engine':>10}{'vs HF':>8}"
        f"{'server: Generate':>18}{'vs engine':>11}{f'GenerateGroup({args.group})':>19}{'vs engine':>11}"
    )
    for batch, hf, local, remote, grouped in rows:
        print(
            f"{batch:>6}{hf:>14.0f}{local:>10.0f}{local / hf:>7.2f}x"
            f"{remote:>18.0f}{remote / local:>10.2f}x{grouped:>19.0f}{grouped / local:>10.2f}x"
        )


if __name__ == "__main__":
    main()
