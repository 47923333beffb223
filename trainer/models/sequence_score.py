"""The sequence-score family: a causal LM's body with a one-output head read at each
row's last token (`AutoModelForSequenceClassification`, one label): a reward model.

Loaded from a causal LM folder the head is new, and zeroed (every score starts at 0);
loaded from a saved reward model it is that model's. The folder it saves is what the
reward-server's `reward_model` domain loads as it ships (its config, weights and
tokenizer, with the padding id the head finds the last token by).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollwire.trainer.models.base import ModelFamily
from rollwire.trainer.models.causal_lm import save_tokenizer, zero_head


@dataclass
class Texts:
    """Right-padded token rows of whole texts, each scored as one sequence."""

    input_ids: torch.Tensor
    """[B, T] token ids, padded with the family's padding id."""
    attention: torch.Tensor
    """[B, T] 1 on tokens, 0 on padding."""


class SequenceScore(ModelFamily):
    """Text in, one score per row out (see the module docstring)."""

    name = "sequence_score"
    lora_task = "SEQ_CLS"

    def load(self, path: Path, *, value_head: bool = False) -> torch.nn.Module:
        if value_head:
            raise ValueError("a sequence-score model has no value head (it is one score)")
        from transformers import AutoConfig, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(Path(path))
        fresh = getattr(config, "num_labels", None) != 1 or not _is_scorer(config)
        config.num_labels = 1
        # The id the head finds each row's last token by: the one the reward-server's
        # tokenizer pads with.
        config.pad_token_id = _padding_id(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            Path(path), config=config, dtype=torch.float32
        )
        if fresh:
            zero_head(model, path)
        return model.train()

    def load_frozen(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        model = self.load(path).to(dtype).eval()
        return model.requires_grad_(False)

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        return self.load(folder).state_dict()

    def logits(self, model: Any, batch: Texts, device: torch.device) -> torch.Tensor:
        """[B] each row's score, at its last token."""
        out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention.to(device))
        return out.logits[:, 0]

    def save_extras(self, source: Path, folder: Path) -> None:
        save_tokenizer(source, folder)

    def pad_token_id(self, config: Any) -> int:
        return int(config.pad_token_id)


def _is_scorer(config: Any) -> bool:
    """The folder holds a sequence-classification model already (its head is trained)."""
    return any(name.endswith("ForSequenceClassification") for name in config.architectures or [])


def _padding_id(path: Path | str) -> int:
    """The tokenizer's padding id, else its end-of-sequence id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    padding = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if padding is None:
        raise ValueError(f"{path}: its tokenizer has neither a padding nor an end token")
    return int(padding)
