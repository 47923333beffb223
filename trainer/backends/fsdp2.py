"""`trainer.backend: fsdp2`: torch FSDP2, parameters, gradients and optimizer state sharded.

`fully_shard` wraps every decoder layer (the classes the model names in
`_no_split_modules`) and then the root, which keeps the embeddings, the final norm
and the head (tied or not) in one group. Each rank loads the model from disk before
sharding it, so a rank needs the full model in CPU memory once at start-up.
Checkpoints are torch.distributed.checkpoint folders (one file per rank plus
metadata; they load on any number of ranks). Runs on CPUs with gloo and on CUDA GPUs
with NCCL; only the CPU path is tested here, the CUDA one by the `gpu` tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollwire.services.core.config.distributed import FSDP2Config
from rollwire.trainer.backends.base import (
    AdamWSettings,
    DistEnv,
    MiB,
    TrainBackend,
    load_master_model,
)
from rollwire.trainer.backends.weights import buckets
from rollwire.trainer.models import CausalLM, ModelFamily


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FSDP2Backend(TrainBackend):
    """FSDP2 over every rank of the default group (`init_process_group` first).

    `precision: bf16` gathers the layers into bfloat16 for forward and backward (the
    shards, the optimizer and the gradient reductions stay float32)."""

    name = "fsdp2"

    def __init__(
        self,
        model_path: str | Path,
        optimizer: AdamWSettings,
        env: DistEnv,
        config: FSDP2Config | None = None,
        precision: Literal["fp32", "bf16"] = "fp32",
        gradient_checkpointing: bool = False,
        value_head: bool = False,
        family: ModelFamily | None = None,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        config = config or FSDP2Config()
        self.model_path = Path(model_path)
        self.rank, self.world_size, self.device = env.rank, env.world_size, env.device
        self.family = family or CausalLM()
        model = load_master_model(self.model_path, gradient_checkpointing, value_head, self.family)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
            reduce_dtype=torch.float32,
        )
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        self.sharded_layers = 0
        for submodule in list(model.modules()):
            if submodule is not model and type(submodule).__name__ in layer_classes:
                fully_shard(
                    submodule,
                    mesh=mesh,
                    mp_policy=policy,
                    reshard_after_forward=config.reshard_after_forward,
                )
                self.sharded_layers += 1
        fully_shard(model, mesh=mesh, mp_policy=policy)  # moves every shard to the device
        self.model = model
        self.optimizer = optimizer.build([p for p in model.parameters() if p.requires_grad])

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def hf_config(self) -> Any:
        return self.model.config

    def backward(self, loss: torch.Tensor) -> None:
        # Each backward reduce-scatters its gradients into the shards (float32), where
        # they accumulate: no full gradient outlives its layer.
        loss.backward()

    @torch.no_grad()
    def clip_and_step(self, max_grad_norm: float) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in grads:
            squares += torch.linalg.vector_norm(_local(grad), 2, dtype=torch.float32).double() ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        norm = math.sqrt(float(squares))
        if math.isfinite(norm):
            # torch.nn.utils.clip_grad_norm_'s coefficient, so backends agree.
            coefficient = min(1.0, max_grad_norm / (norm + 1e-6))
            if coefficient < 1.0:
                for grad in grads:
                    _local(grad).mul_(coefficient)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def iter_full_weights(
        self, bucket_bytes: int = 256 * MiB
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathers each parameter with `DTensor.full_tensor()` (an all-gather), a bucket at a
        time; the other ranks free their copies at once."""
        named = list(self.model.named_parameters())
        for bucket in buckets(named, bucket_bytes):
            gathered = []
            for name, param in bucket:
                full = param.detach()
                if isinstance(full, DTensor):
                    full = full.full_tensor()
                if self.is_main:
                    gathered.append((name, full))
            yield from gathered
            del gathered

    def weight_specs(self) -> list[tuple[str, list[int], torch.dtype]]:
        # A DTensor's shape and dtype are those of the whole (float32 master) parameter.
        return [(n, list(p.shape), p.dtype) for n, p in self.model.named_parameters()]

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, folder: str | Path) -> Path:
        import torch.distributed.checkpoint as dcp

        folder = Path(folder)
        with self.staged(folder) as staging:
            dcp.save(self._state(), checkpoint_id=str(staging))
        return folder

    def load(self, folder: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()  # the shapes and shards to read into
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
