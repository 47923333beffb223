"""The causal language model family: a Hugging Face `AutoModelForCausalLM` folder (or
the built-in tiny model, which is one), its tokenizer saved beside it.

The forward gives next-token logits for every target position; padded and packed rows
(`rollwire.trainer.batching`) attend as their mask or their documents say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollwire.trainer.batching import TokenBatch, packed_attention
from rollwire.trainer.models.base import ModelFamily
from rollwire.trainer.shared_prefix import SharedLayout, share_prefixes, worth_sharing


class CausalLM(ModelFamily):
    """Text in, next-token logits out (see the module docstring)."""

    name = "causal_lm"
    lora_task = "CAUSAL_LM"

    def load(self, path: Path, *, value_head: bool = False) -> torch.nn.Module:
        """The master weights; `value_head`: `AutoModelForTokenClassification` with one
        output, its head zeroed so every value starts at 0 and no dropout before it
        (a critic: `logits[..., 0]` is the value)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        if not value_head:
            return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).train()
        config = AutoConfig.from_pretrained(Path(path))
        config.num_labels, config.classifier_dropout = 1, 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            Path(path), config=config, dtype=torch.float32
        )
        zero_head(model, path)
        return model.train()

    def load_frozen(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=dtype).eval()
        return model.requires_grad_(False)

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()

    def logits(self, model: Any, batch: TokenBatch, device: torch.device) -> torch.Tensor:
        """[B, T-1, V] next-token logits for `batch.targets`, in the compute dtype; with
        `share_prefix`, rows with a common prompt run it once where that costs less
        (`rollwire.trainer.shared_prefix`), the logits the same."""
        if self.share_prefix and batch.documents is None:
            layout = share_prefixes(batch)
            if layout is not None and worth_sharing(layout, batch, model):
                return self._shared_logits(model, layout, device)
        inputs: dict[str, torch.Tensor] = {"attention_mask": batch.attention.to(device)}
        if batch.documents is not None:  # packed rows: block-diagonal attention
            inputs = {
                "attention_mask": packed_attention(batch.documents.to(device)),
                "position_ids": batch.positions.to(device),
            }
        out = model(
            input_ids=batch.input_ids.to(device),
            use_cache=False,  # a training pass has no use for a KV cache
            **inputs,
        )
        return out.logits[:, :-1]

    @staticmethod
    def _shared_logits(model: Any, layout: SharedLayout, device: torch.device) -> torch.Tensor:
        """The batch's [B, T-1, V] logits from one forward over `layout`."""
        out = model(
            input_ids=layout.input_ids.to(device),
            attention_mask=packed_attention(layout.documents.to(device), prefix=True),
            position_ids=layout.positions.to(device),
            use_cache=False,
        )
        flat = out.logits.reshape(-1, out.logits.shape[-1])
        return flat[layout.index.to(device)]

    def save_extras(self, source: Path, folder: Path) -> None:
        """The tokenizer (and the generation config, where the source has one)."""
        save_tokenizer(source, folder)


def save_tokenizer(source: Path, folder: Path) -> None:
    """Copies the tokenizer of the model folder `source` (and its generation config, when
    it has one) into `folder`."""
    import contextlib

    from transformers import AutoTokenizer, GenerationConfig

    with contextlib.suppress(OSError, ValueError):
        GenerationConfig.from_pretrained(source).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)


def zero_head(model: torch.nn.Module, path: Path | str) -> None:
    """Zeroes the new output head of a classification model (`score` or `classifier`)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ValueError(f"{path}: {type(model).__name__} has no output head to zero")
    with torch.no_grad():
        for param in head.parameters():
            param.zero_()
