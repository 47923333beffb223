"""Supervised warm-up: teach a fresh model the answer format before RL.

A randomly initialised model never produces a correct answer, so RL on it has
no signal. A short supervised stage on (prompt, reference answer) pairs gives
it a starting accuracy that RL can then improve; the stage is kept short on
purpose so there is something left to improve.

The stage is `rollwire sft`'s step (`SupervisedStep`) on batches made here
from the run's own dataset (or an env's scripted demonstrations), not a loop of its own.
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


Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list]
"""(token ids, loss mask), and for a vision-language model the sequence's images."""
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
    """Trains on prompt -> response_template.format(answer=...) + eos; loss on the response
    only. A task's images (a vision-language model) go before its prompt text, as the
    orchestrator places them."""
    from transformers import AutoTokenizer

    from rollwire.services.core.vision import VisionSide, is_vision_model

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = int(tokenizer.eos_token_id)
    side = VisionSide(model_path) if is_vision_model(model_path) else None

    def batch(rng: random.Random, size: int) -> list[Example]:
        examples = []
        for task in rng.sample(tasks, size):
            prompt = tokenizer(task.prompt(prompt_template), add_special_tokens=False)["input_ids"]
            images: list = []
            if task.images:
                if side is None:
                    raise ValueError(f"task {task.task_id} has images; {model_path} takes none")
                prompt, images = side.prompt_ids(list(task.images), prompt)
            answer = task.reference
            if off_by_one_rate and rng.random() < off_by_one_rate and _is_int(answer):
                answer = str(int(answer) + 1)
            text = response_template.format(answer=answer)
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            example = (list(prompt) + response, [0] * len(prompt) + [1] * len(response))
            examples.append((*example, images) if side is not None else example)
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
    """Supervised steps on batches drawn by `batch(rng, size)`, the loss on taught tokens
    only: `SupervisedStep.step`, the step of `rollwire sft`, on the local backend in
    float32 with AdamW (betas 0.9/0.999, no weight decay), the gradient norm clipped at
    1, and the rate min(1, (k + 1) / 20) x (1 - k / steps) at update k."""
    from rollwire.services.core.config.trainer import (
        BatchingConfig,
        CheckpointingConfig,
        LRScheduleConfig,
        OptimizerConfig,
        TrainerConfig,
    )
    from rollwire.services.core.tiny import quiet_transformers
    from rollwire.trainer.learner import Learner
    from rollwire.trainer.pipelines.common import save_model
    from rollwire.trainer.pipelines.steps import SupervisedStep

    quiet_transformers()
    torch.manual_seed(seed)
    trainer = TrainerConfig(
        optimizer=OptimizerConfig(learning_rate=learning_rate, adam_betas=(0.9, 0.999)),
        # The warm-up's calibrated shape: a 20-update ramp times a linear decay from the
        # first update (the trainer's default decays only after the ramp, which moved
        # the agentic example's RL from 0.80 to 0.34-0.42 at version 5).
        schedule=LRScheduleConfig(type="linear", warmup_steps=20, decay_from="start"),
        batching=BatchingConfig(micro_batch_size=batch_size),
        threads=threads,
        checkpointing=CheckpointingConfig(every=0, resume=False),
    )
    from rollwire.trainer.models import family_for
    from rollwire.trainer.pipelines.table import CAUSAL_LM

    learner = Learner(model_path, trainer, family_for(CAUSAL_LM, model_path), total_updates=steps)
    supervised = SupervisedStep(learner)
    rng = random.Random(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="warm-up (supervised)", unit="step", leave=False)
    started = time.perf_counter()
    try:
        for _step in range(steps):
            examples = batch(rng, batch_size)
            shown = any(len(e) > 2 for e in examples)
            images = [list(e[2]) if len(e) > 2 else [] for e in examples] if shown else None
            metrics = supervised.step([(e[0], e[1]) for e in examples], images=images)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        save_model(learner, output_path, steps)
    finally:
        if bar is not None:
            bar.close()
        learner.close()
    log.info(
        "warm-up finished",
        extra={"steps": steps, "seconds": round(time.perf_counter() - started, 1)},
    )
    return output_path
