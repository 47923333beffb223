"""`rollwire sft`: supervised fine-tuning of any Hugging Face causal LM on a dataset file.

The model, backend, ranks, precision, LoRA, optimizer and schedule are the trainer
section's, and the step is `Policy.supervised_step` (the loss on the assistant's
tokens, split over ranks by tokens): what RL trains with. Rank 0 reads and renders the
rows (`rollwire.trainer.supervised_data`), sends each step's sequences to the other
ranks, evaluates the held-out loss, and writes the metrics (`metrics/sft.jsonl`) and
checkpoints (`checkpoints/step_*`, resumed from the newest when trainer.resume). The
final model is `<run.output_dir>/final`: a Hugging Face folder `from_pretrained` loads
and `rollwire train` starts from (trainer.model_path).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rollwire.services.core.config import RLSection, RunConfig
from rollwire.services.core.config.algorithms import GRPOAdvantage, KLConfig

log = logging.getLogger(__name__)

Sequences = list[tuple[list[int], list[int]]]


def prepare(config: RunConfig, model_path: Path) -> tuple[Sequences, Sequences, dict[str, Any]]:
    """(training sequences, held-out sequences, what preparing them counted)."""
    from transformers import AutoTokenizer

    from rollwire.services.core.datasets import read_rows
    from rollwire.trainer.supervised_data import held_out_split, supervised_examples

    sft = config.sft
    if sft.data is None:
        raise ValueError("rollwire sft needs sft.data: a .jsonl or .parquet file, or a folder")
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def build(path: Path) -> tuple[Sequences, Any]:
        examples, counts = supervised_examples(
            read_rows(path), tokenizer, sft.max_length, sft.truncate, sft.chat_template
        )
        return [(e.ids, e.mask) for e in examples], counts

    train, counts = build(sft.data)
    report: dict[str, Any] = {"data": counts.summary()}
    if sft.eval_data is not None:
        held, held_counts = build(sft.eval_data)
        report["eval_data"] = held_counts.summary()
    else:
        train, held = held_out_split(train, sft.held_out_fraction, sft.seed)
        report["held_out"] = f"{len(held)} of the kept rows held out"
    if not train:
        raise ValueError(f"{sft.data}: no row left to train on ({counts.summary()})")
    report.update(train_sequences=len(train), held_out_sequences=len(held))
    return train, held, report


def batches(count: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Every step's row indices: each epoch a new seeded order, cut into `batch_size`
    (the last batch of an epoch may be smaller)."""
    out = []
    for epoch in range(epochs):
        order = list(range(count))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, count, batch_size)]
    return out


def _evaluate(policy: Any, held: Sequences, batch_size: int) -> float:
    """The token-mean loss over every held-out sequence."""
    loss_sum, tokens = 0.0, 0.0
    for start in range(0, len(held), batch_size):
        out = policy.supervised_loss(held[start : start + batch_size])
        loss_sum += out["loss"] * out["tokens"]
        tokens += out["tokens"]
    return loss_sum / max(tokens, 1.0)


def run_sft(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire sft`: fine-tune, evaluate, checkpoint; the final model in
    `<run.output_dir>/final`. Above trainer.world_size 1 it runs itself under torchrun."""
    from rollwire.services.core.telemetry import configure_logging
    from rollwire.services.core.tiny import default_model_path
    from rollwire.trainer.loop import torchrun_argv

    if config.trainer.world_size > 1 and "WORLD_SIZE" not in os.environ:
        command = torchrun_argv(config, list(sys.argv[2:] if argv is None else argv), "sft")
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        sys.stdout.flush()
        os.execv(command[0], command)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(
        "sft" if rank == 0 else f"sft-rank{rank}",
        config.telemetry.log_level,
        config.telemetry.log_format,
    )
    model_path = Path(config.trainer.model_path or default_model_path())
    try:
        return _run(config, model_path, rank)
    except (ValueError, FileNotFoundError) as error:
        print(f"rollwire sft: {error}", file=sys.stderr)
        return 1


def _run(config: RunConfig, model_path: Path, rank: int) -> int:
    from rollwire.services.core.files import latest_checkpoint
    from rollwire.trainer.model import Policy

    sft, run_dir = config.sft, Path(config.run.output_dir)
    if rank == 0:
        train, held, report = prepare(config, model_path)
        steps = len(batches(len(train), sft.batch_size, sft.epochs, sft.seed))
        steps = min(steps, sft.max_steps or steps)
    else:
        train, held, report, steps = [], [], {}, 0
    rl = RLSection(group_size=1, max_steps=1, temperature=1.0)
    # The RL-only parts of the trainer section (a critic, a KL reference) stay off.
    trainer = config.trainer.model_copy(update={"advantage": GRPOAdvantage(), "kl": KLConfig()})
    # Every rank builds the same Policy; the schedule's length is known on rank 0 only
    # until it is sent, so the follower ranks take it from the first broadcast below.
    policy = Policy(model_path, trainer, rl)
    steps = int(policy.backend.broadcast_object(steps))
    policy.rl = rl.model_copy(update={"max_steps": steps})
    if policy.followed():
        return 0
    try:
        return _lead(config, policy, train, held, report, steps, run_dir, latest_checkpoint)
    finally:
        policy.close()


def _lead(
    config: RunConfig,
    policy: Any,
    train: Sequences,
    held: Sequences,
    report: dict[str, Any],
    steps: int,
    run_dir: Path,
    latest_checkpoint: Any,
) -> int:
    from tqdm import tqdm

    sft = config.sft
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    for key, value in report.items():
        print(f"{key}: {value}")
    order = batches(len(train), sft.batch_size, sft.epochs, sft.seed)[:steps]
    done = 0
    found = latest_checkpoint(run_dir) if config.trainer.resume else None
    if found is not None:
        done = int(policy.restore(found)["step"])
        print(f"resumed from {found} (step {done} of {steps})")
    metrics_path = run_dir / "metrics" / "sft.jsonl"
    started = time.perf_counter()
    with (
        metrics_path.open("a") as out,
        tqdm(
            total=steps, initial=done, desc="sft", unit="step", disable=not sys.stderr.isatty()
        ) as bar,
    ):

        def write(row: dict[str, Any]) -> None:
            out.write(json.dumps({"time": time.time(), **row}) + "\n")
            out.flush()

        if done == 0 and held:
            write({"step": 0, "eval_loss": _evaluate(policy, held, sft.batch_size)})
        for step in range(done + 1, steps + 1):
            metrics = policy.supervised_step([train[i] for i in order[step - 1]])
            row: dict[str, Any] = {"step": step, **metrics}
            if held and ((sft.eval_every and step % sft.eval_every == 0) or step == steps):
                row["eval_loss"] = _evaluate(policy, held, sft.batch_size)
            write(row)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            if sft.checkpoint_every and step % sft.checkpoint_every == 0 and step < steps:
                policy.save_checkpoint(run_dir / "checkpoints" / f"step_{step:06d}", step, step)
    final = run_dir / "final"
    policy.save_checkpoint(final, steps, steps)
    # The final folder is a model to start from: no resume state in it.
    (final / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(final / "backend", ignore_errors=True)
    seconds = time.perf_counter() - started
    last = _last_eval(metrics_path)
    print(
        f"{steps} steps in {seconds:.0f} s"
        + (f", held-out loss {last:.4f}" if not math.isnan(last) else "")
        + f"\nmodel: {final}\nmetrics: {metrics_path}"
    )
    return 0


def _last_eval(path: Path) -> float:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [row["eval_loss"] for row in rows if "eval_loss" in row]
    return values[-1] if values else math.nan
