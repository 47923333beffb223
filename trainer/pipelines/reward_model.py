"""`rollwire reward-model`: a Bradley-Terry reward model trained on `prompt`/`chosen`/
`rejected` rows, for the reward-server's `reward_model` domain.

The model is trainer.model_path (a causal LM: its body, with a new one-output head read
at each text's last token; `SequenceScore`) on the trainer section's backend, ranks,
precision, LoRA and optimizer. Each row becomes two texts, the prompt with either
response, rendered as the reward-server renders what it scores (a user and an assistant
turn in the tokenizer's chat template when `reward_model.chat` and it has one, else the
two strings joined; cut from the left past max_length). The loss of a pair is
-log sigmoid(r_chosen - r_rejected). Metrics (`metrics/reward-model.jsonl`): loss,
accuracy (pairs scored the right way round) and margin, on each batch and on the
held-out pairs; the final folder (`<run.output_dir>/final`) is what
`reward_server.reward_model.model_path` loads.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rollwire.services.core.config import RunConfig
from rollwire.trainer.learner import Learner, collective
from rollwire.trainer.models.sequence_score import Texts
from rollwire.trainer.pipelines.common import last_value, run_pipeline, split_data, train_steps
from rollwire.trainer.pipelines.data import Counts

Pair = tuple[list[int], list[int]]
"""The token ids of the chosen text and of the rejected one."""


def pairs_of(rows: Any, tokenizer: Any, max_length: int, chat: bool) -> tuple[list[Pair], Counts]:
    """Each row's (chosen ids, rejected ids), tokenised as the reward-server does."""
    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    counts = Counts()

    def ids(prompt: str, response: str) -> list[int]:
        if templated:
            turns = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": response},
            ]
            text = tokenizer.apply_chat_template(turns, tokenize=False)
        else:
            text = prompt + response
        out = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if len(out) > max_length:
            counts.truncated += 1
            out = out[-max_length:]  # the response is at the end: keep it
        return list(out)

    pairs = []
    for index, row in enumerate(rows):
        counts.rows += 1
        where = f"row {index}"
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise ValueError(
                    f"{where}: a reward-model row needs string 'prompt', 'chosen' and "
                    f"'rejected' (the reward-server scores a prompt and a response); "
                    f"{key} is {type(row.get(key)).__name__}"
                )
        chosen, rejected = ids(row["prompt"], row["chosen"]), ids(row["prompt"], row["rejected"])
        if chosen == rejected:
            counts.nothing_to_train += 1  # the same token ids twice: no preference
            continue
        counts.kept += 1
        pairs.append((chosen, rejected))
    return pairs, counts


def prepare(config: RunConfig, model_path: Path) -> tuple[list[Pair], list[Pair], dict[str, Any]]:
    """(training pairs, held-out pairs, what reading them counted)."""
    from transformers import AutoTokenizer

    from rollwire.services.core.datasets import read_rows

    section = config.reward_model
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def build(path: Path) -> tuple[list[Pair], Counts]:
        return pairs_of(read_rows(path), tokenizer, section.max_length, section.chat)

    return split_data("reward-model", section, build, "pairs")


class RewardModelStep:
    """Bradley-Terry steps on a learner of the sequence-score family; attaches itself, so
    `step` runs on every rank, the pairs split over the ranks by tokens."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        learner.attach(self, "reward_model")

    def _texts(self, sequences: list[list[int]]) -> Texts:
        width = max(len(ids) for ids in sequences)
        pad = self.learner.pad_token_id
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
        return Texts(ids, attention)

    @collective
    def step(self, pairs: list[Pair], update: bool = True) -> dict[str, float]:
        """One optimizer update (or, `update=False`, an evaluation) on `pairs`: the mean
        over pairs of -log sigmoid(margin); returns it, `accuracy` (margins above 0)
        and the mean margin and scores."""
        started = time.perf_counter()
        learner = self.learner
        backend, world = learner.backend, learner.backend.world_size
        lengths = [len(c) + len(r) for c, r in pairs]
        chunks = learner.pair_passes(lengths)
        total = float(len(pairs))
        sums = dict.fromkeys(("loss", "accuracy", "margin", "chosen"), 0.0)
        if update:
            backend.zero_grad()
        for chunk in chunks:
            rows = chunk or [0]  # a padding pass runs on a real pair and counts for nothing
            valid = torch.tensor([float(bool(chunk))] * len(rows), device=learner.device)
            texts = self._texts([pairs[i][0] for i in rows] + [pairs[i][1] for i in rows])
            with torch.enable_grad() if update else torch.no_grad():
                scores = learner.forward(texts).float()
                margin = scores[: len(rows)] - scores[len(rows) :]
                numerator = (-torch.nn.functional.logsigmoid(margin) * valid).sum()
                if update:
                    backend.backward(numerator * (world / max(total, 1.0)))
            margin = margin.detach()
            sums["loss"] += float(numerator.detach())
            sums["accuracy"] += float(((margin > 0).float() * valid).sum())
            sums["margin"] += float((margin * valid).sum())
            sums["chosen"] += float((scores[: len(rows)].detach() * valid).sum())
        summed = backend.reduce_metrics(sums, "sum")
        metrics = {key: value / max(total, 1.0) for key, value in summed.items()}
        metrics["chosen_score"] = metrics.pop("chosen")
        metrics["pairs"] = total
        if update:
            metrics.update(learner.optimizer_update())
        metrics["step_seconds"] = time.perf_counter() - started
        return metrics


def _evaluate(step: RewardModelStep, pairs: list[Pair], size: int) -> dict[str, float]:
    """The held-out metrics, means over every pair."""
    totals: dict[str, float] = {}
    for start in range(0, len(pairs), size):
        part = step.step(pairs[start : start + size], update=False)
        for key in ("loss", "accuracy", "margin"):
            totals[key] = totals.get(key, 0.0) + part[key] * part["pairs"]
    return {f"eval_{key}": value / max(len(pairs), 1) for key, value in totals.items()}


def run_reward_model(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire reward-model`: the final model in `<run.output_dir>/final`. Above
    trainer.world_size 1 it runs itself under torchrun (`run_pipeline`)."""
    from rollwire.trainer.pipelines.table import PIPELINES

    entry = PIPELINES["reward-model"]
    section = config.reward_model
    return run_pipeline(
        config, entry.name, section, prepare, _lead, argv, RewardModelStep, entry.family
    )


def _lead(
    config: RunConfig,
    step: RewardModelStep,
    train: list[Pair],
    held: list[Pair],
    report: dict[str, Any],
    steps: int,
) -> int:
    section = config.reward_model
    for key, value in report.items():
        print(f"{key}: {value}")
    final, path, seconds = train_steps(
        config,
        step.learner,
        "reward-model",
        section,
        len(train),
        steps,
        lambda rows: step.step([train[i] for i in rows]),
        (lambda: _evaluate(step, held, section.batch_size)) if held else None,
        lambda metrics: {"loss": f"{metrics['loss']:.3f}", "acc": f"{metrics['accuracy']:.2f}"},
    )
    accuracy = last_value(path, "eval_accuracy")
    print(
        f"{steps} steps in {seconds:.0f} s"
        + (f", held-out preference accuracy {accuracy:.3f}" if accuracy is not None else "")
        + f"\nmodel: {final} (reward_server.reward_model.model_path)\nmetrics: {path}"
    )
    return 0
