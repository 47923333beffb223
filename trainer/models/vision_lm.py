"""The vision-language family: a Hugging Face `AutoModelForImageTextToText` folder of the
Qwen2-VL / Qwen2.5-VL shape (or the built-in tiny one, `run.tiny_model: {vision: 1}`),
its tokenizer and image processor saved beside it.

The forward is the causal LM's with the pixels: each row's images (`TokenBatch.images`,
by value or by reference, opened under the run's `image_inputs` limits) go through the
model's image processor once (`VisionSide.features` keeps them), and the rows get the
three-dimensional rotary positions the model's own `get_rope_index` gives them; the image
placeholder tokens are suppressed in the logits, as the engines suppress them. A row
without images is a text row of the same model; rows with and without images mix in one
batch. Packed rows (`sft.pack_tokens`) are not taken with images.

On a sharded backend (`fsdp2`, `deepspeed`) every rank's forward must run the same
modules, or a rank whose micro-batch has images waits forever for one whose micro-batch
has none to gather the vision tower's shards. A batch without images there gets one
extra row, a blank image's placeholders, whose logits are dropped and join the result
times 0: the vision tower runs on every rank, and its gradients exist (zeros) on all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollwire.services.core.images import ImageLimits, ImageRef
from rollwire.services.core.vision import VisionSide, mrope_positions, suppress
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.models.base import ModelFamily
from rollwire.trainer.models.causal_lm import save_tokenizer


class VisionLM(ModelFamily):
    """Token ids and images in, next-token logits out (see the module docstring)."""

    name = "vision_lm"
    lora_task = "CAUSAL_LM"
    lora_within = "model.language_model"  # LoRA on the language part; the vision tower as it is

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.side: VisionSide | None = None
        self._blank_image: ImageRef | None = None

    def _attach(self, path: Path) -> None:
        if self.side is None:
            self.side = VisionSide(path, self.limits)

    def load(self, path: Path, *, value_head: bool = False) -> torch.nn.Module:
        from transformers import AutoModelForImageTextToText

        if value_head:
            raise ValueError(
                "a critic (advantage gae) is not made for a vision-language model: use a "
                "group-relative advantage (grpo, rloo, dr_grpo, ...)"
            )
        self._attach(Path(path))
        return AutoModelForImageTextToText.from_pretrained(Path(path), dtype=torch.float32).train()

    def load_frozen(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import AutoModelForImageTextToText

        self._attach(Path(path))
        model = AutoModelForImageTextToText.from_pretrained(Path(path), dtype=dtype).eval()
        return model.requires_grad_(False)

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        return model.state_dict()

    def logits(self, model: Any, batch: TokenBatch, device: torch.device) -> torch.Tensor:
        """[B, T-1, V] next-token logits for `batch.targets`, in the compute dtype."""
        assert self.side is not None, "the family's model was not loaded"
        if batch.documents is not None:
            raise ValueError(
                "packed rows (sft.pack_tokens) are not taken by a vision-language model"
            )
        ids, attention = batch.input_ids.to(device), batch.attention.to(device)
        images = [image for row in (batch.images or []) for image in row]
        blank = not images and self.ranks_in_step
        if blank:  # see the module docstring
            images = [self._blank()]
            ids, attention = _with_row(ids, attention, self.side.prompt_ids(images, [])[0])
        if images:
            inputs = self.side.forward_inputs(model, ids, attention, [self.side.features(images)])
        else:
            token = self.side.image_token
            inputs = {"position_ids": mrope_positions(model, ids, attention, None, token)}
        out = model(input_ids=ids, attention_mask=attention, use_cache=False, **inputs)
        logits = suppress(out.logits[:, :-1], self.side.suppressed)
        if blank:
            width = batch.input_ids.shape[1] - 1
            return logits[:-1, :width] + 0.0 * logits[-1].sum()
        return logits

    def _blank(self) -> ImageRef:
        """A black image of the smallest size the processor keeps, made once."""
        if self._blank_image is None:
            from PIL import Image

            from rollwire.services.core.images import encode_png

            side = int(getattr(self.side.processor, "patch_size", 14)) * self.side.merge
            self._blank_image = encode_png(Image.new("RGB", (side, side)))
        return self._blank_image

    def save_extras(self, source: Path, folder: Path) -> None:
        """The tokenizer, the generation config where there is one, and the image processor."""
        from transformers import AutoImageProcessor

        save_tokenizer(source, folder)
        AutoImageProcessor.from_pretrained(source).save_pretrained(folder)

    def pad_token_id(self, config: Any) -> int:
        text = getattr(config, "text_config", config)
        return int(getattr(text, "pad_token_id", None) or 0)


def _with_row(
    ids: torch.Tensor, attention: torch.Tensor, row: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` and `attention` with one more row, all right-padded to the wider of the two."""
    new = torch.tensor([row], dtype=ids.dtype, device=ids.device)
    width = max(ids.shape[1], new.shape[1])

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

    ones = torch.ones_like(new, dtype=attention.dtype)
    return torch.cat([pad(ids), pad(new)]), torch.cat([pad(attention), pad(ones)])
