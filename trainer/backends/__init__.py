"""The trainer's backends, chosen by `trainer.backend`: `local`, `fsdp2` or `deepspeed`.

`backend_for(trainer_config, model_path, distributed)` (or `make_backend`) builds one;
the interface is `TrainBackend` (`base.py`), the multi-process ones live in
`fsdp2.py` and `deepspeed.py` and join the torchrun group
(`init_process_group`). Leave with `backend.close()`, then `shutdown_process_group()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rollwire.services.core.config import TrainerConfig
from rollwire.services.core.config.distributed import DistributedConfig
from rollwire.services.core.config.names import BackendName
from rollwire.trainer.backends.base import (
    AdamWSettings,
    DistEnv,
    LocalBackend,
    TrainBackend,
    init_process_group,
    shutdown_process_group,
    split_by_tokens,
)
from rollwire.trainer.backends.weights import write_pretrained
from rollwire.trainer.models import ModelFamily

__all__ = [
    "AdamWSettings",
    "DistEnv",
    "LocalBackend",
    "TrainBackend",
    "adamw_settings",
    "backend_for",
    "init_process_group",
    "make_backend",
    "shutdown_process_group",
    "split_by_tokens",
    "write_pretrained",
]


def make_backend(
    kind: BackendName,
    model_path: str | Path,
    optimizer: AdamWSettings,
    *,
    device: str = "cpu",
    precision: Literal["fp32", "bf16"] = "fp32",
    gradient_checkpointing: bool = False,
    distributed: DistributedConfig | None = None,
    max_grad_norm: float = 1.0,
    value_head: bool = False,
    family: ModelFamily | None = None,
) -> TrainBackend:
    """The backend `kind` for the model at `model_path`, on `device` (`cpu`, or `cuda`:
    the multi-process backends put each rank on GPU LOCAL_RANK). `fsdp2` and `deepspeed`
    join the default process group first. `precision: bf16` makes FSDP2 gather layers in
    bfloat16; on every backend the caller's autocast does the rest (the weights the
    optimizer updates are float32 everywhere). `max_grad_norm` is DeepSpeed's initial
    clip (each `clip_and_step` sets it again). `value_head`: a critic, the transformer
    with a zeroed one-output head (`load_master_model`). `family`: the kind of model
    (`rollwire.trainer.models`; a causal LM by default)."""
    distributed = distributed or DistributedConfig()
    if kind == "local":
        return LocalBackend(
            model_path, optimizer, device, gradient_checkpointing, None, value_head, family
        )
    env = init_process_group(device, distributed.timeout_seconds)
    if kind == "fsdp2":
        from rollwire.trainer.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(
            model_path,
            optimizer,
            env,
            distributed.fsdp2,
            precision,
            gradient_checkpointing,
            value_head,
            family,
        )
    if kind == "deepspeed":
        from rollwire.trainer.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(
            model_path,
            optimizer,
            env,
            distributed.deepspeed,
            max_grad_norm,
            gradient_checkpointing,
            value_head,
            family,
        )
    raise ValueError(f"unknown trainer backend {kind!r} (local, fsdp2 or deepspeed)")


def adamw_settings(config: TrainerConfig) -> AdamWSettings:
    """The optimizer settings of the trainer section."""
    return AdamWSettings(
        lr=config.optimizer.learning_rate,
        weight_decay=config.optimizer.weight_decay,
        betas=(float(config.optimizer.adam_betas[0]), float(config.optimizer.adam_betas[1])),
        eps=config.optimizer.adam_eps,
    )


def backend_for(
    config: TrainerConfig,
    model_path: str | Path,
    distributed: DistributedConfig | None = None,
    family: ModelFamily | None = None,
) -> TrainBackend:
    """`make_backend` from the trainer section: backend, device, precision, gradient
    checkpointing, AdamW settings and clip (pass `config.distributed` once TrainerConfig
    holds it)."""
    return make_backend(
        config.backend,
        model_path,
        adamw_settings(config),
        device=config.device,
        precision=config.precision,
        gradient_checkpointing=config.gradient_checkpointing,
        distributed=distributed,
        max_grad_norm=config.optimizer.max_grad_norm,
        family=family,
    )
