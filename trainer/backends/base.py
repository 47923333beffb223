"""What every trainer backend offers, the process group they run in, and the one-process backend.

A backend owns the trained module and its optimizer, however they are spread over the
ranks: `local` (one process, `LocalBackend` here), `fsdp2` (`fsdp2.py`) and
`deepspeed` (`deepspeed.py`); `backends.make_backend` picks one by
`trainer.backend`. A train step on any of them reads

    backend.zero_grad()
    for micro_batch in ...:                  # the same number of passes on every rank
        loss = loss_of(backend.module(...))  # scaled as `TrainBackend.backward` says
        backend.backward(loss)
    grad_norm = backend.clip_and_step(max_grad_norm)
    metrics = backend.reduce_metrics(local_metrics, "sum")

Multi-process backends run one process per device under torchrun (`init_process_group`
reads its environment): gloo on CPUs, NCCL between CUDA GPUs with gloo beside it for
CPU tensors. Every method of a backend is collective unless it says otherwise: all
ranks call it, in the same order.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollwire.trainer.backends.weights import write_pretrained
from rollwire.trainer.models import CausalLM, ModelFamily

MiB = 1024 * 1024
ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class AdamWSettings:
    """The optimizer every backend builds (torch AdamW, or DeepSpeed's CPU Adam when
    DeepSpeed offloads it from GPUs)."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8

    def build(self, parameters: list[torch.Tensor]) -> torch.optim.AdamW:
        """torch AdamW over `parameters` with these settings: its fused kernel (one pass over
        each tensor, on every thread) where every parameter is a plain CPU or CUDA tensor;
        torch's default otherwise (sharded parameters: FSDP2's DTensors)."""
        fused = bool(parameters) and all(
            type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in parameters
        )
        return torch.optim.AdamW(
            parameters,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=self.betas,
            eps=self.eps,
            fused=fused or None,
        )


# ---------------------------------------------------------------- splitting a batch


def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Row indices for each rank, so that each rank's sum of `lengths` is about equal.

    Longest rows first, each to the rank with the fewest tokens so far (then the
    fewest rows, then the lowest rank); each rank's rows come back in batch order.
    Deterministic: every rank computes the same split from the same lengths. A rank
    gets no rows only when there are fewer rows than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if any(length < 0 for length in lengths):
        raise ValueError("row lengths cannot be negative")
    tokens = [0] * world_size
    rows: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (tokens[r], len(rows[r]), r))
        tokens[rank] += lengths[index]
        rows[rank].append(index)
    return [sorted(part) for part in rows]


# ---------------------------------------------------------------- the process group


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_process_group(device: str = "cpu", timeout_seconds: float = 600.0) -> DistEnv:
    """Joins (or, when already joined, describes) the default process group.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ... set) it joins the group torchrun
    describes; without it, a group of one over an in-memory store. `device` is `cpu` or
    `cuda` (any index is replaced by LOCAL_RANK: one GPU per process). On CUDA the
    group is `cpu:gloo,cuda:nccl`, so CPU tensors (metrics, objects) still go by gloo;
    the CUDA path needs a GPU per rank and is covered by the `gpu` tests only.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.device(device).type == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asks for CUDA, which this machine lacks")
        torch.cuda.set_device(local_rank)
        here = torch.device("cuda", local_rank)
    else:
        here = torch.device("cpu")
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world_size)
        else:
            if world_size != 1:
                raise RuntimeError(
                    "WORLD_SIZE > 1 without MASTER_ADDR: start the ranks with torchrun"
                )
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, here)


def shutdown_process_group() -> None:
    """Waits for every rank, then leaves the group (a no-op outside one). Collective
    handles still referenced are freed first, while the interpreter is whole."""
    if dist.is_initialized():
        gc.collect()
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        dist.destroy_process_group()


def load_master_model(
    model_path: str | Path,
    gradient_checkpointing: bool = False,
    value_head: bool = False,
    family: ModelFamily | None = None,
) -> Any:
    """The model at `model_path` as its `family` loads it (a causal LM by default) in
    float32 (the master weights, whatever the precision), on the CPU and in training
    mode; with non-reentrant activation checkpointing when asked (no need for inputs
    that require grad, exact gradients). `value_head`: a critic (`ModelFamily.load`)."""
    family = family or CausalLM()
    model = family.load(Path(model_path), value_head=value_head)
    family.freeze(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


# ---------------------------------------------------------------- the interface


class TrainBackend(ABC):
    """The trained model and its optimizer on one rank of a backend.

    Gradients are averaged over ranks (as DDP, FSDP and DeepSpeed do): scale each
    rank's loss so that their mean is the loss you mean. A token mean over the whole
    batch is `sum of this rank's token losses / tokens of the whole batch * world_size`.
    Forward passes are collective on `fsdp2` and ZeRO-3 (they gather parameters): every
    rank runs the same number per step, a rank without rows a pass whose loss is 0.
    """

    name: str
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    model_path: Path
    family: ModelFamily = CausalLM()
    """The kind of model: how it loads, and what is saved beside its weights."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that talks to the buffer and the rollout-servers and writes files."""
        return self.rank == 0

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """What to run forward on (a Hugging Face causal LM, or the engine around one)."""

    @property
    @abstractmethod
    def hf_config(self) -> Any:
        """The model's Hugging Face config."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Adds this loss's gradients; may be called several times before a step."""

    @abstractmethod
    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clips the gradients to a global norm (over every shard of every rank), steps
        the optimizer, drops the gradients and returns the norm before clipping. A norm
        that is not finite skips the step (the weights and optimizer state stay as they
        were) and is returned: NaN, or inf from DeepSpeed."""

    optimizer: torch.optim.Optimizer
    """The optimizer over this rank's parameters (or shards)."""

    def zero_grad(self) -> None:
        """Drops the gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group (for a schedule)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @abstractmethod
    def iter_full_weights(
        self, bucket_bytes: int = 256 * MiB
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, full tensor) for every parameter on the main rank, by the names a
        freshly loaded Hugging Face model uses, gathering at most one bucket of about
        `bucket_bytes` at a time; float32 master weights, on the backend's device.

        Collective: every rank must run it to the end (the other ranks yield nothing),
        and the main rank should not keep the tensors past the next item's bucket.
        """

    @abstractmethod
    def weight_specs(self) -> list[tuple[str, list[int], torch.dtype]]:
        """(name, full shape, dtype) of what `iter_full_weights` yields, in its order,
        without gathering anything: what a receiver needs to know before the tensors
        come. Not collective."""

    @abstractmethod
    def save(self, folder: str | Path) -> Path:
        """Writes the sharded model and optimizer state for an exact resume, atomically
        (every rank writes its part; a shared filesystem across nodes)."""

    @abstractmethod
    def load(self, folder: str | Path) -> None:
        """Restores what `save` wrote, into a backend built the same way."""

    def save_pretrained(
        self, folder: str | Path, bucket_bytes: int = 256 * MiB, shard_bytes: int = 2048 * MiB
    ) -> Path:
        """Writes a consolidated Hugging Face folder (config, safetensors, and what the
        family saves beside them: a tokenizer) on the main rank, atomically; the family's
        `from_pretrained` loads it. Collective."""
        folder = Path(folder)
        with self.staged(folder) as staging:
            weights = self.iter_full_weights(bucket_bytes)
            if self.is_main:
                write_pretrained(
                    staging,
                    self.hf_config,
                    weights,
                    shard_bytes,
                    self.family.weights_stem,
                    self.family.save_config,
                )
                self.family.save_extras(self.model_path, staging)
            else:
                for _ in weights:
                    pass
        return folder

    def reduce_metrics(self, metrics: dict[str, float], op: ReduceOp = "mean") -> dict[str, float]:
        """The metrics summed, averaged, or their max or min over ranks; every rank gets the
        result. Every rank must pass the same keys (a difference is a ValueError)."""
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"unknown reduction {op!r}")
        if self.world_size == 1:
            return {key: float(value) for key, value in metrics.items()}
        keys = sorted(metrics)
        crc = float(zlib.crc32("\0".join(keys).encode()))
        check = torch.tensor([crc, -crc], dtype=torch.float64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if float(check[0]) != crc or float(-check[1]) != crc:
            raise ValueError(f"ranks reduce different metrics; rank {self.rank} has {keys}")
        sign = -1.0 if op == "min" else 1.0
        values = torch.tensor([sign * float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(values, op=_OPS.get(op, dist.ReduceOp.MAX))
        values *= sign
        if op == "mean":
            values /= self.world_size
        return dict(zip(keys, values.tolist(), strict=True))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank (pickled): e.g. the batch rank 0 took from the buffer."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (pickled), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj)
        return box

    def barrier(self) -> None:
        """Waits for every rank (bounded by the group's timeout)."""
        if self.world_size > 1:
            dist.barrier()

    @contextlib.contextmanager
    def staged(self, folder: Path) -> Iterator[Path]:
        """A staging folder every rank writes into; on success it replaces `folder` whole.

        A rank that fails leaves the others waiting at the closing barrier until the group's
        timeout; the half-written staging folder is removed by the next save.
        """
        staging = folder.with_name(f".{folder.name}.staging")
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.barrier()
        yield staging
        self.barrier()
        if self.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staging, folder)
        self.barrier()

    def close(self) -> None:
        """Releases what the backend holds (not the process group: `shutdown_process_group`)."""
        return None


# ---------------------------------------------------------------- one process


class LocalBackend(TrainBackend):
    """One process, the whole model on one device (`trainer.device`); what `Policy` does
    today. Needs no process group. float32 weights: `trainer.precision: bf16` is the
    caller's autocast."""

    name = "local"

    def __init__(
        self,
        model_path: str | Path,
        optimizer: AdamWSettings,
        device: str = "cpu",
        gradient_checkpointing: bool = False,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        value_head: bool = False,
        family: ModelFamily | None = None,
    ) -> None:
        """`wrap` turns the loaded model into the trained one (e.g. peft's LoRA model); the
        optimizer holds only the parameters that then require grad. `value_head`: a
        critic (`load_master_model`)."""
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.family = family or CausalLM()
        model = load_master_model(self.model_path, gradient_checkpointing, value_head, self.family)
        model = model.to(self.device)
        self.model = (wrap(model) if wrap is not None else model).train()
        self.optimizer = optimizer.build([p for p in self.model.parameters() if p.requires_grad])

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def hf_config(self) -> Any:
        return self.model.config

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_and_step(self, max_grad_norm: float) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm))
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def iter_full_weights(
        self, bucket_bytes: int = 256 * MiB
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def weight_specs(self) -> list[tuple[str, list[int], torch.dtype]]:
        return [(n, list(p.shape), p.dtype) for n, p in self.model.named_parameters()]

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        with self.staged(folder) as staging:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, staging / "state.pt")
        return folder

    def load(self, folder: str | Path) -> None:
        state = torch.load(Path(folder) / "state.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
