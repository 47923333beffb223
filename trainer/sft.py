"""Supervised warm-up: teach a fresh model the answer format before RL.

A randomly initialised model never produces a correct answer, so RL on it has
no signal. A short supervised stage on (prompt, reference answer) pairs gives
it a starting accuracy that RL can then improve; the stage is kept short on
purpose so there is something left to improve.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rollwire.services.core.datasets import Task

log = logging.getLogger(__name__)


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


Example = tuple[list[int], list[int]]
"""Token ids and, per token, 1 where the model is taught it (the policy's part)."""


def warm_up(
    model_path: Path,
    output_path: Path,
    tasks: Sequence[Task],
    prompt_template: str,
    response_template: str,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
    off_by_one_rate: float = 0.0,
) -> Path:
    """Trains on prompt -> response_template.format(answer=...) + eos; loss on the response only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = int(tokenizer.eos_token_id)

    def batch(rng: random.Random, size: int) -> list[Example]:
        examples = []
        for task in rng.sample(tasks, size):
            prompt = tokenizer(task.prompt(prompt_template), add_special_tokens=False)["input_ids"]
            answer = task.reference
            if off_by_one_rate and rng.random() < off_by_one_rate and _is_int(answer):
                answer = str(int(answer) + 1)
            text = response_template.format(answer=answer)
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            examples.append((list(prompt) + response, [0] * len(prompt) + [1] * len(response)))
        return examples

    return warm_up_on(
        model_path, output_path, batch, steps, batch_size, learning_rate, seed, threads, progress
    )


def warm_up_on(
    model_path: Path,
    output_path: Path,
    batch: Callable[[random.Random, int], list[Example]],
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
) -> Path:
    """Supervised steps on batches drawn by `batch(rng, size)`; the loss covers taught tokens only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollwire.services.core.tiny import quiet_transformers

    quiet_transformers()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * max(0.0, 1 - step / steps)
    )
    rng = random.Random(seed)
    pad = int(tokenizer.pad_token_id)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="warm-up (supervised)", unit="step", leave=False)
    started = time.perf_counter()
    for _step in range(steps):
        rows = batch(rng, batch_size)
        length = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch_size, length), pad, dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, length), dtype=torch.long)
        for row, (sequence, taught) in enumerate(rows):
            values = torch.tensor(sequence)
            ids[row, : len(sequence)] = values
            attention[row, : len(sequence)] = 1
            labels[row, : len(sequence)] = torch.where(
                torch.tensor(taught, dtype=torch.bool), values, torch.tensor(-100)
            )
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    if bar is not None:
        bar.close()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_path)
    tokenizer.save_pretrained(output_path)
    log.info(
        "warm-up finished",
        extra={"steps": steps, "seconds": round(time.perf_counter() - started, 1)},
    )
    return output_path
