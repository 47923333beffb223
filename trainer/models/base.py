"""What differs between kinds of trained model, behind one small interface.

A `ModelFamily` says how a model of its kind is loaded (master weights and a frozen
copy), how its forward runs on a batch, its padding id, what is saved beside its
weights (a tokenizer today; a processor or a noise scheduler for the families to
come), LoRA's targets and task, and how its weights are named on the wire to the
rollout-servers. The `Learner` (trainer/learner.py) holds one and knows no other model
detail; the steps (trainer/rl/, trainer/pipelines/) call its forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch


class ModelFamily(ABC):
    """One kind of model. Subclasses are stateless apart from their settings."""

    name: str
    """The family's name in the table (`rollwire.trainer.models.FAMILIES`)."""

    lora_task: str
    """peft's `TaskType` name for LoRA on this family (e.g. `CAUSAL_LM`); empty for a model
    peft wraps without a task (a diffusers UNet)."""

    lora_within: str = ""
    """A module prefix LoRA's adapters stay inside (`trainer.lora.target_modules` match
    only below it); empty: anywhere in the model."""

    frozen: tuple[str, ...] = ()
    """Module prefixes whose parameters do not train (`trainer.freeze`), applied by
    `freeze` when the master weights are loaded."""

    ranks_in_step: bool = False
    """Set by the learner on a sharded backend: every rank's forward must run the same
    modules, whatever its micro-batch holds (see models/vision_lm.py)."""

    share_prefix: bool = False
    """Set by the learner (`trainer.batching.share_prefix`): rows that begin with the same
    prompt compute it once, where the family's forward can (see models/causal_lm.py)."""

    weights_stem: str = "model"
    """The stem of a saved folder's safetensors files as the family's `from_pretrained`
    looks for them (`model.safetensors`, or `model-00001-of-00002.safetensors` and
    `model.safetensors.index.json`)."""

    @abstractmethod
    def load(self, path: Path, *, value_head: bool = False) -> torch.nn.Module:
        """The model at `path` in float32 on the CPU, in training mode: the master
        weights. `value_head`: the same body with a zeroed one-output head per position
        (a critic), where the family has one."""

    @abstractmethod
    def load_frozen(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        """The model at `path` in `dtype`, evaluation mode, no gradients (a reference)."""

    @abstractmethod
    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        """The float32 weights of a saved folder, by the names `load` gives them."""

    @abstractmethod
    def logits(self, model: Any, batch: Any, device: torch.device) -> torch.Tensor:
        """The model's forward on `batch` (the caller holds the precision's autocast)."""

    @abstractmethod
    def save_extras(self, source: Path, folder: Path) -> None:
        """Writes into `folder` what a saved model needs beside its weights and config,
        read from the model folder the run started from."""

    def save_config(self, config: Any, folder: Path) -> None:
        """Writes the model's config (`backend.hf_config`) into `folder` the way its
        `from_pretrained` reads it (a transformers config saves itself)."""
        config.save_pretrained(folder)

    def pad_token_id(self, config: Any) -> int:
        """The id padding positions hold (never attended to, never in a loss)."""
        return int(getattr(config, "pad_token_id", None) or 0)

    def freeze(self, model: torch.nn.Module) -> None:
        """Stops the parameters under `frozen`'s prefixes from training; ValueError for a
        prefix that names none (a typo would otherwise train everything silently)."""
        names = [name for name, _ in model.named_parameters()]
        for prefix in self.frozen:
            hits = [name for name in names if name == prefix or name.startswith(prefix + ".")]
            if not hits:
                tops = sorted({name.rsplit(".", 2)[0] for name in names})[:8]
                raise ValueError(
                    f"trainer.freeze: {prefix!r} names no parameter of the model (some of its "
                    f"modules: {', '.join(tops)})"
                )
        for name, param in model.named_parameters():
            if any(name == p or name.startswith(p + ".") for p in self.frozen):
                param.requires_grad_(False)

    def wire_name(self, name: str) -> str:
        """A parameter's name as the rollout-servers load it (the same by default)."""
        return name
