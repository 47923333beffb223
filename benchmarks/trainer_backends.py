"""Trainer backends side by side: memory per rank, step time, and gathering weights to publish.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_backends.py [--steps 4] [--shape small]

One fixed batch (16 sequences of 96-160 tokens, half of them generated, rewards that
give every sequence an advantage) trains the 27M-parameter Qwen2 shape of
benchmarks/engines.py (`--shape small`, built offline) with `rollwire.trainer.learner.Policy`,
the trainer process's own step, under each setting in turn:

- `local` fp32, `local` bf16, `local` LoRA (rank 16 on q/k/v/o): one process.
- `fsdp2`, `deepspeed` ZeRO-2 and ZeRO-3: two ranks under torchrun (gloo).

Per rank: the bytes of the parameters it holds, of their gradients after the
backward passes (before the step), of the optimizer state, and the growth of its
resident memory from before the model was loaded to the end (RSS, /proc). Step time
is the median over `--steps` steps after one warm-up step; trained tokens/s counts
generated tokens. `gather` is what a sharded backend adds before publishing: the
full weights gathered to rank 0 (`Policy._gather`); `encode` is what every backend
does, the weights cut into the chunks a rollout-server receives. Ratios are
against `local` fp32 of the same run. This machine has two cores: two ranks of one
thread each use both, one local process one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROWS, GROUP = 16, 4
SETTINGS = {
    "local fp32": ({"backend": "local"}, 0),
    "local bf16": ({"backend": "local", "precision": "bf16"}, 0),
    "local LoRA": ({"backend": "local", "lora": {"rank": 16}}, 0),
    "fsdp2 x2": ({"backend": "fsdp2", "world_size": 2}, 2),
    "ZeRO-2 x2": ({"backend": "deepspeed", "world_size": 2}, 2),
    "ZeRO-3 x2": (
        {"backend": "deepspeed", "world_size": 2, "distributed": {"deepspeed": {"zero_stage": 3}}},
        2,
    ),
}


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trajectories(vocab: int, version: int = 0) -> list:
    from rollwire.services.core.wire import Trajectory

    rng = np.random.default_rng(0)
    out = []
    for i in range(ROWS):
        length = int(rng.integers(96, 161))
        ids = rng.integers(3, vocab, length).astype(np.int32)
        mask = (np.arange(length) >= length // 2).astype(np.uint8)
        out.append(
            Trajectory(
                trajectory_id=f"t{i}",
                task_id=f"g{i // GROUP}",
                group_id=f"g{i // GROUP}",
                sample_index=i % GROUP,
                prompt_ordinal=i // GROUP,
                source="bench",
                domain="bench",
                token_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=np.full(length, -5.0, np.float32),
                policy_versions=np.where(mask == 1, version, -1).astype(np.int64),
                reward=float(i % 2),
            )
        )
    return out


def local_bytes(tensor: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)  # ZeRO-3 keeps only its partition
    if partition is not None:
        tensor = partition
    return tensor.numel() * tensor.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)  # a ZeRO optimizer wraps torch's
    return sum(
        local_bytes(value)
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def gradient_bytes(policy) -> int:
    """Bytes of gradients this rank holds once the backward passes are done: ZeRO keeps
    its partitions in the optimizer (a flat buffer, or per-group lists), the others in
    each parameter's `.grad`."""
    optimizer = policy.learner.backend.optimizer
    held = 0
    for holder in ("grads_in_partition", "averaged_gradients", "all_grad_tensors"):
        value = getattr(optimizer, holder, None)
        if isinstance(value, torch.Tensor):
            held += local_bytes(value)
        elif isinstance(value, dict | list):
            for grads in value.values() if isinstance(value, dict) else value:
                for grad in grads if isinstance(grads, list) else [grads]:
                    held += local_bytes(grad) if isinstance(grad, torch.Tensor) else 0
    return held + sum(local_bytes(p.grad) for p in policy.learner.model.parameters())


def worker(setting: str, model: Path, steps: int, out: Path) -> None:
    from rollwire.rollout.server.weights import iter_weight_chunks
    from rollwire.services.core.config import RLSection, TrainerConfig
    from rollwire.trainer.rl.policy import Policy

    torch.set_num_threads(1)
    # The libraries' own memory is not the model's: imported before the baseline.
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    if "LoRA" in setting:
        import peft  # noqa: F401
    if "ZeRO" in setting:
        import deepspeed  # noqa: F401
    before = rss_bytes()
    config = TrainerConfig(**SETTINGS[setting][0], micro_batch_size=4, learning_rate=1e-5)
    policy = Policy(model, config, RLSection(group_size=GROUP, max_steps=steps + 1))
    if policy.followed():  # ranks other than 0 did what rank 0 asked
        return
    batch = trajectories(int(policy.learner.backend.hf_config.vocab_size))
    tokens = sum(int(t.loss_mask.sum()) for t in batch)
    # Gradient bytes: the backward passes of one minibatch, before its step.
    grads = {}
    original = policy.learner.backend.clip_and_step

    def measured(norm: float) -> float:
        grads.setdefault("bytes", gradient_bytes(policy))
        return original(norm)

    policy.learner.backend.clip_and_step = measured
    seconds, gathered = [], []
    for step in range(steps + 1):
        started = time.perf_counter()
        metrics = policy.train_step(batch, step)
        # The gather ends the step on sharded backends; it is timed on its own.
        gathered.append(metrics.get("time_gather_seconds", 0.0))
        seconds.append(time.perf_counter() - started - gathered[-1])
    gathered = statistics.median(gathered[1:])
    encoded = time.perf_counter()
    chunks = sum(1 for _ in iter_weight_chunks(policy.named_weights(), 1, 4 * 1024 * 1024))
    encoded = time.perf_counter() - encoded
    result = {
        "params": sum(local_bytes(p) for p in policy.learner.model.parameters()),
        "grads": grads.get("bytes", 0),
        "optimizer": state_bytes(policy.learner.backend.optimizer),
        "rss_growth": rss_bytes() - before,
        "step_seconds": statistics.median(seconds[1:]),
        "tokens_per_second": tokens / statistics.median(seconds[1:]),
        "gather_seconds": gathered,
        "encode_seconds": encoded,
        "chunks": chunks,
    }
    policy.close()
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shape", choices=["tiny", "small"], default="small")
    parser.add_argument("--only", nargs="*", choices=list(SETTINGS), help="some settings only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.steps, args.out)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from engines import SHAPES

    from rollwire.services.core.tiny import ensure_tiny_model

    scratch = Path(tempfile.mkdtemp(prefix="rollwire-backends-"))
    model = ensure_tiny_model(scratch / "model", SHAPES[args.shape])
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for setting in args.only or SETTINGS:
        ranks = SETTINGS[setting][1]
        out = scratch / f"{setting.replace(' ', '_')}.json"
        command = [sys.executable, __file__, "--worker", setting, "--model", str(model)]
        command += ["--steps", str(args.steps), "--out", str(out)]
        if ranks:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(ranks),
                *command[1:],
            ]
        print(f"{setting} ...", flush=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0 or not out.exists():
            print(done.stdout[-3000:], done.stderr[-6000:])
            continue
        results[setting] = json.loads(out.read_text())
    base = results.get("local fp32")
    mib = 1024 * 1024
    print(f"\n{args.shape} shape, {ROWS} sequences a step, median of {args.steps} steps\n")
    header = (
        "setting",
        "params",
        "grads",
        "optim",
        "p+g+o",
        "x local",
        "RSS+",
        "step s",
        "x local",
        "tok/s",
        "gather s",
        "encode s",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for setting, r in results.items():
        total = r["params"] + r["grads"] + r["optimizer"]
        base_total = base["params"] + base["grads"] + base["optimizer"] if base else total
        print(
            f"| {setting} | {r['params'] / mib:.1f} MiB | {r['grads'] / mib:.1f} MiB | "
            f"{r['optimizer'] / mib:.1f} MiB | {total / mib:.1f} MiB | {total / base_total:.2f} | "
            f"{r['rss_growth'] / mib:.0f} MiB | {r['step_seconds']:.2f} | "
            f"{r['step_seconds'] / (base or r)['step_seconds']:.2f} | {r['tokens_per_second']:.0f} | "
            f"{r['gather_seconds']:.3f} | {r['encode_seconds']:.3f} |"
        )


if __name__ == "__main__":
    main()
