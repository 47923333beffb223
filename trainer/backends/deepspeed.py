"""`trainer.backend: deepspeed`: DeepSpeed ZeRO stage 1, 2 or 3 over the default group.

The engine runs in float32 with the caller owning gradient accumulation
(`managed_gradient_accumulation: false`): `backward` only accumulates (stage 2 and 3
reduce-scatter as they go), and `clip_and_step` is the boundary where gradients are
reduced, clipped to the global norm and the optimizer steps. Each rank loads the whole
model before `deepspeed.initialize` partitions it (stage 3 without `zero.Init`).
Checkpoints are DeepSpeed's own (`save_checkpoint`: a model file and one optimizer
partition per rank). On CPUs DeepSpeed uses its CPU accelerator over gloo and compiles
a shared-memory op on first use (cached under ~/.cache/torch_extensions); on CUDA GPUs,
NCCL, and with `offload_optimizer` its CPU Adam (compiled on first use). Only the CPU
path is tested here, the CUDA one by the `gpu` tests.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollwire.services.core.config.distributed import DeepSpeedConfig
from rollwire.trainer.backends.base import (
    AdamWSettings,
    DistEnv,
    MiB,
    TrainBackend,
    load_master_model,
)
from rollwire.trainer.backends.weights import buckets
from rollwire.trainer.models import CausalLM, ModelFamily

_TAG = "state"


def deepspeed_config(config: DeepSpeedConfig, max_grad_norm: float) -> dict[str, Any]:
    """The DeepSpeed config dict for these settings (batch sizes are nominal: the caller
    feeds micro-batches and calls step itself)."""
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if config.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # torch AdamW where DeepSpeed's CPU Adam is not worth compiling (CPU runs).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend(TrainBackend):
    """A DeepSpeed engine over every rank of the default group (`init_process_group` first).

    The engine holds float32 weights; `trainer.precision: bf16` is the caller's autocast
    around the forward pass, as on the local backend."""

    name = "deepspeed"

    def __init__(
        self,
        model_path: str | Path,
        optimizer: AdamWSettings,
        env: DistEnv,
        config: DeepSpeedConfig | None = None,
        max_grad_norm: float = 1.0,
        gradient_checkpointing: bool = False,
        value_head: bool = False,
        family: ModelFamily | None = None,
    ) -> None:
        import deepspeed

        config = config or DeepSpeedConfig()
        self.stage = config.zero_stage
        self.model_path = Path(model_path)
        self.rank, self.world_size = env.rank, env.world_size
        self.family = family or CausalLM()
        model = load_master_model(self.model_path, gradient_checkpointing, value_head, self.family)
        if env.device.type == "cuda":
            model.to(env.device)
        settings = {
            "lr": optimizer.lr,
            "weight_decay": optimizer.weight_decay,
            "betas": optimizer.betas,
            "eps": optimizer.eps,
        }
        trained = [p for p in model.parameters() if p.requires_grad]  # trainer.freeze
        if config.offload_optimizer and env.device.type == "cuda":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            inner = DeepSpeedCPUAdam(trained, adamw_mode=True, **settings)
        else:
            inner = torch.optim.AdamW(trained, **settings)
        # DeepSpeed reads these even in a group it did not make (one process, no torchrun).
        names = {"RANK": env.rank, "WORLD_SIZE": env.world_size, "LOCAL_RANK": env.local_rank}
        for key, value in names.items():
            os.environ.setdefault(key, str(value))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=inner,
            config=deepspeed_config(config, max_grad_norm),
            dist_init_required=False,
        )
        self.device = torch.device(self.engine.device)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine

    @property
    def hf_config(self) -> Any:
        return self.engine.module.config

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def clip_and_step(self, max_grad_norm: float) -> float:
        # The ZeRO optimizers clip inside their step to `clip_grad` (set from the config's
        # gradient_clipping); a schedule of norms only has to set it.
        self.engine.optimizer.clip_grad = max_grad_norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        self.engine.optimizer.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self.engine.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def iter_full_weights(
        self, bucket_bytes: int = 256 * MiB
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stages 1 and 2 hold every parameter whole on every rank: the main rank yields
        them as they are. Stage 3 gathers a bucket at a time with
        `deepspeed.zero.GatheredParameters` (an all-gather on every rank)."""
        named = list(self.engine.module.named_parameters())
        if self.stage < 3:
            if self.is_main:
                for name, param in named:
                    yield name, param.detach()
            return
        import deepspeed

        def full_size(param: torch.nn.Parameter) -> int:
            return int(getattr(param, "ds_numel", param.numel())) * param.element_size()

        for bucket in buckets(named, bucket_bytes, full_size):
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                gathered = [(n, p.data.detach().clone()) for n, p in bucket] if self.is_main else []
            yield from gathered
            del gathered

    def weight_specs(self) -> list[tuple[str, list[int], torch.dtype]]:
        # Stage 3 leaves an empty tensor in each parameter; ds_shape is the whole one.
        return [
            (n, list(getattr(p, "ds_shape", p.shape)), p.dtype)
            for n, p in self.engine.module.named_parameters()
        ]

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        with self.staged(folder) as staging:
            self.engine.save_checkpoint(str(staging), tag=_TAG, save_latest=False)
        return folder

    def load(self, folder: str | Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(folder),
            tag=_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {_TAG!r} under {folder}")

    def close(self) -> None:
        self.engine.destroy()
        # The engine and its ZeRO optimizer hold pending collective handles; freed here,
        # not at interpreter exit, where a gloo thread freeing them can abort the rank.
        del self.engine, self.optimizer
        gc.collect()
