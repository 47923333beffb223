"""The `reward_model` domain: a Hugging Face sequence-classification model scores each
(prompt, response) inside the reward-server.

The one module of the reward room that imports torch and transformers, and only when the
domain is configured (`reward_server.reward_model`); a reward-server without it stays light.
Items are scored in batches of `batch_size` on one worker thread (a forward pass cannot
be cut short, so a batch that outlives its time limit gives its items a timeout error and
the next batch waits for it to end).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollwire.reward.scorers import Score, ScoreInput

if TYPE_CHECKING:
    from rollwire.services.core.config import RewardModelConfig

INSTALL_HINT = (
    "the reward_model domain needs torch and transformers in the reward-server's "
    "environment: pip install 'rollwire[rollout]' (or drop reward_server.reward_model)"
)


class RewardModel:
    """The `reward_model` domain's scorer: `await model.score(items, timeout, deadline)`."""

    def __init__(self, config: RewardModelConfig) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as error:
            raise RuntimeError(f"{INSTALL_HINT} ({error})") from None
        self.config = config
        self.name = f"reward model {config.model_path} ({config.output} of label {config.label})"
        self.description = "A sequence-classification model's score (reward_server.reward_model)."
        torch.set_num_threads(config.threads)
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer.truncation_side = "left"  # the response is at the end: keep it
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.model_path, dtype=getattr(torch, config.dtype)
        ).to(config.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:  # it finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = self.model.config.num_labels
        if config.label >= labels:
            raise ValueError(
                f"reward_model.label {config.label} is outside the head's {labels} outputs"
            )
        if config.output == "softmax" and labels < 2:
            raise ValueError("reward_model.output softmax needs a head of two or more outputs")
        self._busy = threading.Lock()  # one forward pass at a time, in call order

    def text(self, item: ScoreInput) -> str:
        """What the model reads: a user and an assistant turn in the chat template, or the
        prompt and response joined."""
        if self.config.chat and self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [
                    {"role": "user", "content": item.prompt},
                    {"role": "assistant", "content": item.response},
                ],
                tokenize=False,
            )
        return item.prompt + item.response

    def score_batch(self, items: Sequence[ScoreInput]) -> list[Score]:
        """Scores of `items` in one forward pass (blocking)."""
        torch = self._torch
        with self._busy:
            encoded = self.tokenizer(
                [self.text(item) for item in items],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.config.max_length,
                add_special_tokens=not (self.config.chat and self.tokenizer.chat_template),
            ).to(self.config.device)
            with torch.no_grad():
                logits = self.model(**encoded).logits.float()
        label = self.config.label
        if self.config.output == "softmax":
            values = logits.softmax(dim=-1)[:, label]
        elif self.config.output == "sigmoid":
            values = logits[:, label].sigmoid()
        else:
            values = logits[:, label]
        raw = logits[:, label]
        return [
            Score(float(value), {"logit": float(logit)})
            for value, logit in zip(values.tolist(), raw.tolist(), strict=True)
        ]

    async def score(
        self, items: Sequence[ScoreInput], timeout: float, deadline: float | None = None
    ) -> list[Score | BaseException]:
        """A score per item, in order, or TimeoutError for the items of a batch that did not
        end within `timeout` (or by the event loop's `deadline`)."""
        loop = asyncio.get_running_loop()
        size = self.config.batch_size
        results: list[Score | BaseException] = []
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            limit = timeout if deadline is None else min(timeout, deadline - loop.time())
            if limit <= 0:
                results += [TimeoutError("no time was left within the call's deadline")] * len(
                    chunk
                )
                continue
            try:
                results += await asyncio.wait_for(asyncio.to_thread(self.score_batch, chunk), limit)
            except TimeoutError:
                message = f"the reward model's batch took longer than {limit:.3g}s"
                results += [TimeoutError(message) for _ in chunk]
            except Exception as error:  # a bad item or model: this batch's items, not the call
                failure: Any = RuntimeError(f"{type(error).__name__}: {error}"[:500])
                results += [failure] * len(chunk)
        return results

    async def close(self) -> None:
        return None
