"""The trainer's distributed backends: `trainer.backend: fsdp2 | deepspeed` and their settings.

Read by `rollwire.trainer.backends`. Imports neither torch nor grpc; each field's
docstring is its help text. `trainer.backend: local` reads none of it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollwire.services.core.config.runtime import StrictModel


class FSDP2Config(StrictModel):
    """`trainer.backend: fsdp2`: torch FSDP2 (`fully_shard` on every decoder layer and
    on the root module), one process per device under torchrun. With `trainer.precision:
    bf16` layers are gathered into bfloat16 (float32 master weights, optimizer state and
    gradient reductions)."""

    reshard_after_forward: bool = True
    """Free a layer's gathered parameters after its forward and gather them again for
    backward (least memory, like ZeRO-3); false keeps them until backward (one gather
    fewer per step, like ZeRO-2)."""


class DeepSpeedConfig(StrictModel):
    """`trainer.backend: deepspeed`: DeepSpeed ZeRO, one process per device under torchrun."""

    zero_stage: Literal[1, 2, 3] = 2
    """What is partitioned across ranks: 1 the optimizer state, 2 also the gradients,
    3 also the parameters (gathered layer by layer for forward and backward)."""
    offload_optimizer: bool = False
    """Keep the optimizer state and run the optimizer step in CPU memory (ZeRO-Offload).
    On GPUs the step then runs DeepSpeed's CPU Adam, which it compiles on first use."""
    offload_params: bool = False
    """Stage 3 only: keep the partitioned parameters in CPU memory between uses."""

    @model_validator(mode="after")
    def _params_offload_needs_stage_3(self) -> DeepSpeedConfig:
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                "offload_params needs zero_stage 3 (only stage 3 partitions parameters)"
            )
        return self


class DistributedConfig(StrictModel):
    """Settings of the multi-process trainer backends (`trainer.backend: fsdp2 | deepspeed`)."""

    timeout_seconds: float = Field(600.0, gt=0)
    """The longest any collective (a gather, a reduction, a barrier) may wait for the
    other ranks; past it the process group fails instead of hanging."""
    fsdp2: FSDP2Config = FSDP2Config()
    """`backend: fsdp2` settings."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """`backend: deepspeed` settings."""
