"""`rollwire dpo`: preference tuning (DPO, IPO, SimPO) of any Hugging Face causal LM on
`prompt`/`chosen`/`rejected` rows.

The reference is the model as it starts: before the first update its logprob sums of
every pair's responses are computed once (and kept in `<run.output_dir>/reference.pt`,
so a resumed run does not recompute them from moved weights), with no second copy of
the model. The steps are `PreferenceStep.step` on the trainer section's backend,
ranks, precision, LoRA and optimizer. Metrics (`metrics/dpo.jsonl`): loss, implicit
reward margin, preference accuracy and the chosen/rejected logprobs, on the training
batch and on the held-out pairs; the final model is `<run.output_dir>/final`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rollwire.services.core.config import RunConfig
from rollwire.trainer.pipelines.common import (
    last_value,
    run_pipeline,
    split_data,
    train_steps,
)

Pair = tuple[tuple, tuple]
"""(chosen, rejected), each (token ids, loss mask), or (token ids, loss mask, images) when
the prompt shows images (a vision-language model)."""


def prepare(config: RunConfig, model_path: Path) -> tuple[list[Pair], list[Pair], dict[str, Any]]:
    """(training pairs, held-out pairs, what preparing them counted)."""
    from transformers import AutoTokenizer

    from rollwire.services.core.datasets import read_rows
    from rollwire.services.core.vision import VisionSide, is_vision_model
    from rollwire.trainer.pipelines.data import preference_examples

    dpo = config.dpo
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    limits = config.image_inputs.limits()
    vision = VisionSide(model_path, limits) if is_vision_model(model_path) else None

    def build(path: Path) -> tuple[list[Pair], Any]:
        pairs, counts = preference_examples(
            read_rows(path),
            tokenizer,
            dpo.max_length,
            dpo.truncate,
            dpo.chat_template,
            vision,
            path if path.is_dir() else path.parent,
        )

        def side(rendered: Any) -> tuple:
            if rendered.images:
                return (rendered.ids, rendered.mask, list(rendered.images))
            return (rendered.ids, rendered.mask)

        return [(side(c), side(r)) for c, r in pairs], counts

    return split_data("dpo", dpo, build, "pairs")


def run_dpo(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire dpo`: the final model in `<run.output_dir>/final`. Above
    trainer.world_size 1 it runs itself under torchrun (`run_pipeline`)."""
    from rollwire.trainer.pipelines.steps import PreferenceStep

    return run_pipeline(config, "dpo", config.dpo, prepare, _lead, argv, PreferenceStep)


def _reference(step: Any, pairs: list[Pair], batch_size: int) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start in range(0, len(pairs), batch_size):
        out += step.sequence_logprobs(pairs[start : start + batch_size])
    return out


def _evaluate(
    step: Any, pairs: list[Pair], reference: list[tuple[float, float]], settings: dict, size: int
) -> dict[str, float]:
    """The held-out metrics, means over every pair."""
    totals: dict[str, float] = {}
    for start in range(0, len(pairs), size):
        part = step.step(
            pairs[start : start + size], reference[start : start + size], settings, update=False
        )
        for key in (
            "loss",
            "reward_margin",
            "accuracy",
            "prefers_chosen",
            "chosen_logprob",
            "rejected_logprob",
        ):
            totals[key] = totals.get(key, 0.0) + part[key] * part["pairs"]
    return {f"eval_{key}": value / max(len(pairs), 1) for key, value in totals.items()}


def _lead(
    config: RunConfig,
    preference: Any,
    train: list[Pair],
    held: list[Pair],
    report: dict[str, Any],
    steps: int,
) -> int:
    import torch

    dpo, run_dir = config.dpo, Path(config.run.output_dir)
    settings = {
        "loss": dpo.loss,
        "beta": dpo.beta,
        "gamma": dpo.gamma,
        "sft_weight": dpo.sft_weight,
    }
    for key, value in report.items():
        print(f"{key}: {value}")
    saved = run_dir / "reference.pt"
    if saved.exists():
        reference = torch.load(saved, weights_only=True)
    else:
        started = time.perf_counter()
        reference = {
            "train": _reference(preference, train, dpo.batch_size),
            "held": _reference(preference, held, dpo.batch_size),
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.save(reference, saved)
        print(
            f"reference logprobs of {len(train) + len(held)} pairs: {time.perf_counter() - started:.1f} s"
        )
    if len(reference["train"]) != len(train) or len(reference["held"]) != len(held):
        raise ValueError(f"{saved} belongs to other data; remove it to compute it again")

    def step(rows: list[int]) -> dict[str, float]:
        pairs = [train[i] for i in rows]
        return preference.step(pairs, [reference["train"][i] for i in rows], settings)

    def evaluate() -> dict[str, float]:
        return _evaluate(preference, held, reference["held"], settings, dpo.batch_size)

    final, path, seconds = train_steps(
        config,
        preference.learner,
        "dpo",
        dpo,
        len(train),
        steps,
        step,
        evaluate if held else None,
        lambda metrics: {"loss": f"{metrics['loss']:.3f}", "acc": f"{metrics['accuracy']:.2f}"},
    )
    prefers = last_value(path, "eval_prefers_chosen")
    print(
        f"{steps} steps in {seconds:.0f} s"
        + (f", held-out pairs preferring the chosen: {prefers:.3f}" if prefers is not None else "")
        + f"\nmodel: {final}\nmetrics: {path}"
    )
    return 0
