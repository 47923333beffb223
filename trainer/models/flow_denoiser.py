"""The flow-matching denoiser family: a diffusers `UNet2DModel` conditioned on a class
label, predicting the velocity of rectified flow (`rollwire.diffusion.flow`).

A model folder is the UNet's `config.json` and weights at its root (what
`UNet2DModel.from_pretrained` loads, and what the learner's checkpoints write), with its
noise scheduler in `scheduler/` and rollwire's description of the task
(`rollwire_diffusion.json`: image shape, value range, labels) beside it: `save_extras`
copies both from the folder the run started from. The built-in model
(`rollwire.diffusion.digits`) is one. LoRA targets the UNet's convolutions and linear
layers by name (`trainer.lora.target_modules`, e.g. `["conv1", "conv2", "time_emb_proj"]`).

The family's forward (`logits`) takes a `Noised` batch and returns the predicted velocity.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollwire.diffusion.data import ANY
from rollwire.diffusion.digits import velocity
from rollwire.trainer.models.base import ModelFamily

MARKER = "rollwire_diffusion.json"
WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors")


@dataclass
class Noised:
    """Noisy samples at their times, with the labels they are conditioned on."""

    x: torch.Tensor
    """[B, C, H, W] noisy samples."""
    t: torch.Tensor
    """[B] times in [0, 1] (1 is pure noise)."""
    labels: torch.Tensor
    """[B] class labels (the folder's `any_label` for the unconditional branch)."""


class FlowDenoiser(ModelFamily):
    """A class-conditional flow-matching UNet (see the module docstring)."""

    name = "flow_denoiser"
    lora_task = ""
    """peft without a task type: the UNet is no transformers model."""
    weights_stem = "diffusion_pytorch_model"
    """What diffusers' `from_pretrained` looks for."""

    def load(self, path: Path, *, value_head: bool = False) -> torch.nn.Module:
        if value_head:
            raise ValueError("a flow denoiser has no value head (Flow-GRPO needs no critic)")
        from diffusers import UNet2DModel

        return UNet2DModel.from_pretrained(Path(path), torch_dtype=torch.float32).train()

    def load_frozen(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        from diffusers import UNet2DModel

        model = UNet2DModel.from_pretrained(Path(path), torch_dtype=dtype).eval()
        return model.requires_grad_(False)

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        for name in WEIGHTS:
            if (Path(folder) / name).exists():
                weights = load_file(str(Path(folder) / name))
                return {key: value.to(torch.float32) for key, value in weights.items()}
        raise FileNotFoundError(f"no UNet weights in {folder} (looked for {', '.join(WEIGHTS)})")

    def logits(self, model: Any, batch: Noised, device: torch.device) -> torch.Tensor:
        return velocity(model, batch.x.to(device), batch.t.to(device), batch.labels.to(device))

    def save_extras(self, source: Path, folder: Path) -> None:
        source, folder = Path(source), Path(folder)
        if (source / "scheduler").is_dir():
            shutil.copytree(source / "scheduler", folder / "scheduler", dirs_exist_ok=True)
        if (source / MARKER).exists():
            shutil.copy2(source / MARKER, folder / MARKER)

    def save_config(self, config: Any, folder: Path) -> None:
        """The UNet's `config.json` as diffusers writes it (its class, version, settings),
        from the model's frozen config (what the sharded backends hold)."""
        import diffusers

        settings = {key: value for key, value in dict(config).items() if not key.startswith("_")}
        text = json.dumps(
            {"_class_name": "UNet2DModel", "_diffusers_version": diffusers.__version__, **settings},
            indent=2,
            sort_keys=True,
        )
        (Path(folder) / "config.json").write_text(text + "\n")

    def pad_token_id(self, config: Any) -> int:
        return 0  # images have no padding


def any_label_of(folder: Path) -> int:
    """The unconditional branch's label of a model folder (its task file), 10 without one."""
    marker = Path(folder) / MARKER
    if marker.exists():
        return int(json.loads(marker.read_text()).get("any_label", ANY))
    return ANY
