"""`rollwire sft`: supervised fine-tuning of any Hugging Face causal LM on a dataset file.

The model, backend, ranks, precision, LoRA, optimizer and schedule are the trainer
section's, and the step is `SupervisedStep` (the loss on the assistant's tokens, split
over ranks by tokens) on the `Learner` RL trains with. Rank 0 reads and renders the
rows (`rollwire.trainer.pipelines.data`), sends each step's sequences to the other
ranks, evaluates the held-out loss, and writes the metrics (`metrics/sft.jsonl`) and
checkpoints (`checkpoints/step_*`, resumed from the newest when trainer.checkpointing.resume). The
final model is `<run.output_dir>/final`: a Hugging Face folder `from_pretrained` loads
and `rollwire train` starts from (trainer.model_path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollwire.services.core.config import RunConfig
from rollwire.trainer.pipelines.common import (
    last_value,
    run_pipeline,
    split_data,
    train_steps,
)

Sequences = list[tuple]
"""(token ids, loss mask), or with a KL loss (token ids, loss mask, teacher top-k), or
with images (token ids, loss mask, teacher top-k or None, images)."""


def prepare(config: RunConfig, model_path: Path) -> tuple[Sequences, Sequences, dict[str, Any]]:
    """(training sequences, held-out sequences, what preparing them counted)."""
    from transformers import AutoTokenizer

    from rollwire.services.core.datasets import read_rows
    from rollwire.services.core.tokenizer import tokenizer_digest
    from rollwire.services.core.vision import VisionSide, is_vision_model
    from rollwire.trainer.pipelines.data import distill_examples, supervised_examples

    sft = config.sft
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    limits = config.image_inputs.limits()
    vision = VisionSide(model_path, limits) if is_vision_model(model_path) else None

    def build(path: Path) -> tuple[Sequences, Any]:
        folder = path if path.is_dir() else path.parent
        if sft.loss != "nll":
            distilled, counts = distill_examples(
                read_rows(path),
                sft.max_length,
                sft.truncate,
                tokenizer_digest(model_path),
                vision,
                folder,
            )
            if any(e.images for e in distilled):
                return [
                    (e.ids, e.mask, (e.top_ids, e.top_logprobs), list(e.images)) for e in distilled
                ], counts
            return [(e.ids, e.mask, (e.top_ids, e.top_logprobs)) for e in distilled], counts
        examples, counts = supervised_examples(
            read_rows(path),
            tokenizer,
            sft.max_length,
            sft.truncate,
            sft.chat_template,
            vision,
            folder,
        )
        if any(e.images for e in examples):
            if sft.packing:
                raise ValueError("sft.packing is not taken with images (each row is its own)")
            return [(e.ids, e.mask, None, list(e.images)) for e in examples], counts
        return [(e.ids, e.mask) for e in examples], counts

    return split_data("sft", sft, build, "sequences")


def _step_args(items: Sequences) -> tuple[list, list | None, list | None]:
    """A step's (token ids, mask) sequences, their teacher top-k when they have it, and
    their images when they show some."""
    width = len(items[0]) if items else 2
    top = [item[2] for item in items] if width > 2 and items[0][2] is not None else None
    images = [item[3] for item in items] if width == 4 else None
    return [item[:2] for item in items], top, images


def _evaluate(step: Any, held: Sequences, batch_size: int, pack: int | None, loss: str) -> float:
    """The token-mean loss over every held-out sequence."""
    loss_sum, tokens = 0.0, 0.0
    for start in range(0, len(held), batch_size):
        sequences, top, images = _step_args(held[start : start + batch_size])
        out = step.loss(sequences, pack, loss, top, images)
        loss_sum += out["loss"] * out["tokens"]
        tokens += out["tokens"]
    return loss_sum / max(tokens, 1.0)


def run_sft(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire sft`: the final model in `<run.output_dir>/final`. Above
    trainer.world_size 1 it runs itself under torchrun (`run_pipeline`)."""
    from rollwire.trainer.pipelines.steps import SupervisedStep

    return run_pipeline(config, "sft", config.sft, prepare, _lead, argv, SupervisedStep)


def _lead(
    config: RunConfig,
    supervised: Any,
    train: Sequences,
    held: Sequences,
    report: dict[str, Any],
    steps: int,
) -> int:
    sft = config.sft
    for key, value in report.items():
        print(f"{key}: {value}")
    pack = sft.max_length if sft.packing else None

    def step(rows: list[int]) -> dict[str, float]:
        sequences, top, images = _step_args([train[i] for i in rows])
        return supervised.step(sequences, pack, sft.loss, top, images)

    final, path, seconds = train_steps(
        config,
        supervised.learner,
        "sft",
        sft,
        len(train),
        steps,
        step,
        (lambda: {"eval_loss": _evaluate(supervised, held, sft.batch_size, pack, sft.loss)})
        if held
        else None,
        lambda metrics: {"loss": f"{metrics['loss']:.3f}"},
    )
    last = last_value(path, "eval_loss")
    print(
        f"{steps} steps in {seconds:.0f} s"
        + (f", held-out loss {last:.4f}" if last is not None else "")
        + f"\nmodel: {final}\nmetrics: {path}"
    )
    return 0
