"""A vision-language model's image side, the same in the orchestrator, the engines and the trainer.

A model folder is a vision-language one when its config has a `vision_config` (the
Qwen2-VL and Qwen2.5-VL shape: an image is `<|vision_start|>`, one `<|image_pad|>` per
merged patch, `<|vision_end|>`, and its pixels go beside the token ids). `VisionSide`
reads the folder's image processor and placeholder ids once and then:

- `prompt_ids(images, text_ids)`: the placeholders of each image (as many pad tokens as
  the model reads it as) before the text, and where each image starts;
- `features(images)`: the processor's `pixel_values` and `image_grid_thw` for the forward,
  each image processed once and kept (`CACHED_IMAGES`): a group's samples share their
  prompt's image, and the trainer's passes and epochs see the same images again;
- `check(token_ids, images)`: the pad tokens and the images agree (a clear ImageError if
  not), before any forward is run on them.

`mrope_positions` gives the three-dimensional rotary positions such a model takes, for
right- or left-padded rows, from the model's own `get_rope_index`.

The placeholder tokens are never generated: a sampled `<|image_pad|>` would stand for
pixels nobody has. The engines and the trainer both apply `suppress` to the logits, so
the policy they agree on is the model's distribution over every other token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollwire.services.core.images import ImageError, ImageLimits, ImageRef, open_image


def is_vision_model(folder: str | Path) -> bool:
    """Whether the model folder holds a vision-language model (its config has a vision part)."""
    config = Path(folder) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


CACHED_IMAGES = 4096
"""Processed images a `VisionSide` keeps, the least recently used let go first."""


@dataclass
class Features:
    """An image list's processor output: `pixel_values` [patches, dim], `grid` [N, 3]."""

    pixel_values: Any
    grid: Any


class VisionSide:
    """The image processor and placeholder ids of a vision-language model folder."""

    def __init__(self, folder: str | Path, limits: ImageLimits | None = None) -> None:
        from transformers import AutoImageProcessor

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        if "vision_config" not in config:
            raise ValueError(f"{folder} is not a vision-language model (no vision_config)")
        self.image_token = int(config["image_token_id"])
        self.start = int(config["vision_start_token_id"])
        self.end = int(config["vision_end_token_id"])
        self.processor = AutoImageProcessor.from_pretrained(folder)
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)
        self.limits = limits or ImageLimits()
        self.suppressed = sorted(
            {
                self.image_token,
                self.start,
                self.end,
                int(config.get("video_token_id", self.image_token)),
            }
        )
        """Token ids the model never generates (`suppress`)."""
        self._processed: OrderedDict[tuple[bytes, str], tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()  # the engine processes requests' images on threads

    def features(self, images: list[ImageRef]) -> Features:
        """The pixels of `images` as the model's forward takes them, in order (each image
        processed once, by its bytes or its reference, then kept)."""
        import torch

        keys = [(image.data, image.uri) for image in images]
        with self._lock:
            missing = {k: i for k, i in zip(keys, images, strict=True) if k not in self._processed}
        if missing:
            opened = [open_image(image, self.limits) for image in missing.values()]
            out = self.processor(images=opened, return_tensors="pt")
            sizes = [int(row.prod()) for row in out["image_grid_thw"]]
            pixels = torch.split(out["pixel_values"], sizes)
            with self._lock:
                for key, part, grid in zip(missing, pixels, out["image_grid_thw"], strict=True):
                    self._processed[key] = (part, grid)
                    if len(self._processed) > CACHED_IMAGES:
                        self._processed.popitem(last=False)
        with self._lock:
            parts = [self._processed[key] for key in keys]
            for key in keys:
                self._processed.move_to_end(key)
        return Features(torch.cat([p for p, _ in parts]), torch.stack([g for _, g in parts]))

    def token_counts(self, features: Features) -> list[int]:
        """How many pad tokens the model reads each image as."""
        return [int(row.prod()) // self.merge**2 for row in features.grid]

    def marker(self, tokenizer: Any, count: int) -> str:
        """The text that stands for `count` images before their expansion (`expand`): one
        `<|vision_start|><|image_pad|><|vision_end|>` each, as a chat template writes them."""
        one = "".join(tokenizer.convert_ids_to_tokens([self.start, self.image_token, self.end]))
        return one * count

    def expand(
        self, ids: list[int], images: list[ImageRef], mask: list[int] | None = None
    ) -> tuple[list[int], list[int], list[ImageRef]]:
        """`ids` rendered with one pad token per image (`marker`), each pad made as many as
        the model reads its image as; `mask` grows with 0s there. Returns the ids, the
        mask and the images with their offsets. ImageError if the pads and images differ."""
        mask = [0] * len(ids) if mask is None else mask
        pads = [i for i, token in enumerate(ids) if token == self.image_token]
        if len(pads) != len(images):
            raise ImageError(
                f"the text holds {len(pads)} image placeholders for {len(images)} image(s)"
            )
        if not images:
            return list(ids), list(mask), []
        counts = self.token_counts(self.features(images))
        out_ids: list[int] = []
        out_mask: list[int] = []
        placed = []
        last = 0
        for pad, image, count in zip(pads, images, counts, strict=True):
            out_ids += ids[last:pad]
            out_mask += mask[last:pad]
            placed.append(image.with_offset(len(out_ids)))
            out_ids += [self.image_token] * count
            out_mask += [0] * count
            last = pad + 1
        return out_ids + list(ids[last:]), out_mask + list(mask[last:]), placed

    def prompt_ids(
        self, images: list[ImageRef], text_ids: list[int]
    ) -> tuple[list[int], list[ImageRef]]:
        """Each image's placeholders, then `text_ids`; and the images with their offsets
        (what the marker before a plain prompt's text expands to)."""
        one = [self.start, self.image_token, self.end]
        ids, _, placed = self.expand(one * len(images) + list(text_ids), images)
        return ids, placed

    def placed(self, ids: list[int], images: list[ImageRef]) -> list[ImageRef]:
        """`images` at the runs of pad tokens of already expanded `ids` (a token-level
        row's), in order; ImageError unless each run is as long as its image makes."""
        runs: list[list[int]] = []  # [start, length] of each run of pad tokens
        for i, token in enumerate(ids):
            if token == self.image_token:
                if runs and runs[-1][0] + runs[-1][1] == i:
                    runs[-1][1] += 1
                else:
                    runs.append([i, 1])
        if len(runs) != len(images):
            raise ImageError(f"the tokens hold {len(runs)} image(s) for {len(images)} given")
        counts = self.token_counts(self.features(images)) if images else []
        for number, ((_, length), count) in enumerate(zip(runs, counts, strict=True)):
            if length != count:
                raise ImageError(
                    f"image {number} has {length} pad tokens where the model reads it as "
                    f"{count}: the ids were made with another image processor"
                )
        return [image.with_offset(start) for image, (start, _) in zip(images, runs, strict=True)]

    def collapse(self, ids: list[int]) -> list[int]:
        """`ids` with each image's run of pad tokens as one pad (the form before `expand`,
        which an engine that expands placeholders itself, as vLLM does, takes)."""
        return [
            token
            for i, token in enumerate(ids)
            if token != self.image_token or i == 0 or ids[i - 1] != self.image_token
        ]

    def check(self, token_ids: list[int], images: list[ImageRef]) -> Features | None:
        """The features of `images` if the token ids hold exactly their pad tokens;
        ImageError otherwise (also for pad tokens without images). None: no images."""
        pads = sum(1 for token in token_ids if token == self.image_token)
        if not images:
            if pads:
                raise ImageError(f"the tokens hold {pads} image pad tokens but no image was given")
            return None
        features = self.features(images)
        wanted = sum(self.token_counts(features))
        if pads != wanted:
            raise ImageError(
                f"the tokens hold {pads} image pad tokens, but the {len(images)} image(s) "
                f"given make {wanted}: each image's placeholders must be made for it "
                "(VisionSide.prompt_ids)"
            )
        return features

    def forward_inputs(self, model: Any, ids: Any, attention: Any, shown: list[Features]) -> dict:
        """What a forward over padded rows `ids` takes beside them when their images are
        `shown` (in row order): the model's three-dimensional positions, the pixels and
        the grid, on the rows' device (the model casts the pixels to its own dtype)."""
        import torch

        grid = torch.cat([f.grid for f in shown]).to(ids.device)
        return {
            "position_ids": mrope_positions(model, ids, attention, grid, self.image_token),
            "pixel_values": torch.cat([f.pixel_values for f in shown]).to(ids.device),
            "image_grid_thw": grid,
        }


SUPPRESSED_LOGIT = -1.0e9
"""The logit a suppressed token gets: finite (no inf or nan in any product with a zero
mask), and far enough below every other that its probability is exactly 0 in float32."""


def suppress(logits: Any, token_ids: list[int]) -> Any:
    """`logits` [..., V] with the `token_ids` columns set to SUPPRESSED_LOGIT (a copy)."""
    import torch

    index = torch.tensor(token_ids, device=logits.device)
    return logits.index_fill(-1, index, SUPPRESSED_LOGIT)


def mrope_positions(model: Any, input_ids: Any, attention: Any, grid: Any, image_token: int) -> Any:
    """[3, B, T] rotary positions of a Qwen2-VL-shaped model for padded rows (padding
    positions 0), by the model's own `get_rope_index`; `grid` None: text-only rows."""
    import torch

    inner = getattr(model, "model", model)
    while not hasattr(inner, "get_rope_index") and hasattr(inner, "model"):
        inner = inner.model  # a peft wrapper, or the base model of one
    types = (input_ids == image_token).int()
    mask = attention.to(input_ids.device)
    positions, _ = inner.get_rope_index(
        input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask
    )
    return torch.where(mask.bool()[None], positions, torch.zeros_like(positions))
