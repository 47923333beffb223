"""One rank of the backend checks in tests/trainer/test_backends.py (run directly for `local`, under
torchrun for the others): optimizer steps on fixed batches, results written to --out.

`--phase train`: the parameter names and shapes `iter_full_weights` gives, a step on
batch A, the gathered weights, `save` and `save_pretrained`, a step on batch B and the
weights again. `--phase resume`: a fresh backend `load`s the checkpoint, then the same
step on batch B. The loss is a masked token mean of -logprob over the whole batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rollwire.services.core.config.distributed import DeepSpeedConfig, DistributedConfig
from rollwire.trainer.backends import (
    AdamWSettings,
    TrainBackend,
    make_backend,
    shutdown_process_group,
    split_by_tokens,
)

OPTIMIZER = AdamWSettings(lr=1e-3, weight_decay=0.01)
MAX_GRAD_NORM = 0.5
MICRO_BATCH = 2
BUCKET_BYTES = 16 * 1024  # small: the tiny model gathers in many buckets


def make_batch(
    seed: int, rows: int = 7, vocab: int = 100
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rows of 6..29 random tokens; the last two thirds of each count as generated."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 30, (rows,), generator=generator).tolist()
    ids = [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]
    masks = [(torch.arange(n) >= n // 3).float() for n in lengths]
    return ids, masks


def token_loss(module, ids: list[torch.Tensor], masks: list[torch.Tensor], device) -> torch.Tensor:
    """Sum over generated targets of -logprob, for right-padded rows."""
    width = max(len(row) for row in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    attention = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width)
    for i, (row, row_mask) in enumerate(zip(ids, masks, strict=True)):
        input_ids[i, : len(row)], attention[i, : len(row)], mask[i, : len(row)] = row, 1, row_mask
    input_ids, attention, mask = input_ids.to(device), attention.to(device), mask.to(device)
    logits = module(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return -(logprobs * mask[:, 1:]).sum()


def step(backend: TrainBackend, batch) -> tuple[float, float]:
    """One optimizer step on the whole batch, split across ranks by tokens; (loss, norm)."""
    ids, masks = batch
    total = float(sum(m[1:].sum() for m in masks))
    mine = split_by_tokens([len(row) for row in ids], backend.world_size)[backend.rank]
    chunks = [mine[i : i + MICRO_BATCH] for i in range(0, len(mine), MICRO_BATCH)]
    # Forward passes gather parameters on fsdp2 and ZeRO-3: the same number on every rank.
    passes = int(backend.reduce_metrics({"passes": len(chunks)}, "max")["passes"])
    backend.zero_grad()
    local = 0.0
    for index in range(passes):
        rows, weight = (chunks[index], 1.0) if index < len(chunks) else (mine[:1] or [0], 0.0)
        summed = token_loss(
            backend.module, [ids[r] for r in rows], [masks[r] for r in rows], backend.device
        )
        loss = summed * (weight * backend.world_size / total)
        backend.backward(loss)
        local += float(summed.detach()) * weight / total
    norm = backend.clip_and_step(MAX_GRAD_NORM)
    return backend.reduce_metrics({"loss": local}, "sum")["loss"], norm


def poisoned_step(backend: TrainBackend, batch) -> float:
    """A step whose gradients are NaN: it must be skipped; returns its norm."""
    ids, masks = batch
    rows = split_by_tokens([len(row) for row in ids], backend.world_size)[backend.rank][:1] or [0]
    backend.zero_grad()
    summed = token_loss(
        backend.module, [ids[r] for r in rows], [masks[r] for r in rows], backend.device
    )
    backend.backward(summed * float("nan"))
    return backend.clip_and_step(MAX_GRAD_NORM)


def check_collectives(backend: TrainBackend) -> None:
    """The metric reductions and the object broadcast; mismatched keys are an error on
    every rank rather than a wrong sum."""
    rank, world = backend.rank, backend.world_size
    metrics = {"a": rank + 1.0, "b": -2.0 * rank}
    ranks = [r + 1.0 for r in range(world)]
    assert backend.reduce_metrics(metrics, "sum")["a"] == sum(ranks)
    assert backend.reduce_metrics(metrics, "mean")["a"] == sum(ranks) / world
    assert backend.reduce_metrics(metrics, "max") == {"a": float(world), "b": 0.0}
    assert backend.reduce_metrics(metrics, "min") == {"a": 1.0, "b": -2.0 * (world - 1)}
    assert backend.broadcast_object({"from": rank, "rows": [1, 2]}) == {"from": 0, "rows": [1, 2]}
    if world > 1:
        try:
            backend.reduce_metrics({f"only_on_{rank}": 1.0})
        except ValueError:
            pass
        else:
            raise AssertionError("different metric keys on different ranks were not caught")


def gather(backend: TrainBackend) -> dict[str, torch.Tensor]:
    return {name: t.to("cpu").clone() for name, t in backend.iter_full_weights(BUCKET_BYTES)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["local", "fsdp2", "deepspeed"], required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["train", "resume"], default="train")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--offload-optimizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from safetensors.torch import save_file

    from rollwire.services.core.tiny import quiet_transformers

    quiet_transformers()
    distributed = DistributedConfig(
        timeout_seconds=120,
        deepspeed=DeepSpeedConfig(
            zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer
        ),
    )
    backend = make_backend(
        args.backend,
        args.model,
        OPTIMIZER,
        device=args.device,
        precision=args.precision,
        gradient_checkpointing=args.gradient_checkpointing,
        distributed=distributed,
        max_grad_norm=MAX_GRAD_NORM,
    )
    out = args.out
    hf_model = getattr(backend.module, "module", backend.module)  # inside a DeepSpeed engine
    results: dict[str, object] = {
        "world_size": backend.world_size,
        "checkpointing": hf_model.is_gradient_checkpointing,
    }
    try:
        if args.phase == "train":
            check_collectives(backend)
            results["shapes"] = {name: list(t.shape) for name, t in gather(backend).items()}
            specs = backend.weight_specs()
            results["specs"] = {name: shape for name, shape, _ in specs}
            assert all(dtype == torch.float32 for _, _, dtype in specs)
            results["loss1"], results["norm1"] = step(backend, make_batch(1))
            weights1 = gather(backend)
            backend.save(out / "checkpoint")
            backend.save_pretrained(
                out / "pretrained", bucket_bytes=BUCKET_BYTES, shard_bytes=64 * 1024
            )
            results["loss2"], results["norm2"] = step(backend, make_batch(2))
            weights2 = gather(backend)
            results["poisoned_norm"] = str(poisoned_step(backend, make_batch(3)))
            after = gather(backend)
            results["poisoned_changed"] = [
                k for k in after if not torch.equal(after[k], weights2[k])
            ]
            if backend.is_main:
                save_file(weights1, str(out / "weights1.safetensors"))
                save_file(weights2, str(out / "weights2.safetensors"))
        else:
            backend.load(out / "checkpoint")
            loaded = gather(backend)
            results["loss2"], results["norm2"] = step(backend, make_batch(2))
            weights2 = gather(backend)
            if backend.is_main:
                save_file(loaded, str(out / "resumed_weights1.safetensors"))
                save_file(weights2, str(out / "resumed_weights2.safetensors"))
        if backend.is_main:
            (out / f"{args.phase}.json").write_text(json.dumps(results))
        backend.barrier()
    finally:
        backend.close()
        shutdown_process_group()


if __name__ == "__main__":
    main()
