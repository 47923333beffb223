"""What the pipelines around RL (`rollwire sft`, `rollwire dpo`, `rollwire
reward-model`) share: running as trainer.world_size ranks, a `Learner` with the
pipeline's step, the order of the rows, resuming from the newest checkpoint, the
metrics file, and the final model folder.

Rank 0 leads (reads the data, runs each step, writes files); the other ranks follow
its collective calls, as trainer ranks do.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from rollwire.services.core.config import RunConfig


def become_ranks(config: RunConfig, command: str, argv: list[str] | None = None) -> int:
    """Above trainer.world_size 1 and outside torchrun, turns this process into torchrun
    running `rollwire COMMAND ARGV` once per rank (it does not return); else returns
    this process's rank, with logging set up as `COMMAND` or `COMMAND-rankN`."""
    from rollwire.services.core.telemetry import configure_logging
    from rollwire.trainer.learner import torchrun_argv

    if config.trainer.world_size > 1 and "WORLD_SIZE" not in os.environ:
        line = torchrun_argv(config, list(sys.argv[2:] if argv is None else argv), command)
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        sys.stdout.flush()
        os.execv(line[0], line)
    rank = int(os.environ.get("RANK", "0"))
    name = command if rank == 0 else f"{command}-rank{rank}"
    configure_logging(name, config.telemetry.log_level, config.telemetry.log_format)
    return rank


def run_pipeline(
    config: RunConfig,
    command: str,
    section: Any,
    prepare: Callable[[RunConfig, Path], tuple[list, list, dict[str, Any]]],
    lead: Callable[..., int],
    argv: list[str] | None = None,
    make_step: Callable[[Any], Any] | None = None,
    family: str = "rollwire.trainer.models.causal_lm:CausalLM",
) -> int:
    """A pipeline's whole run: the ranks (`become_ranks`), rank 0's data (`prepare`:
    training rows, held-out rows, what it counted), the number of steps from
    `section`'s batch_size, epochs, seed and max_steps, the `Learner` of the model
    `family` and its step (`make_step(learner)`, on every rank); rank 0 then runs
    `lead(config, step, train, held, report, steps)` while the others follow. A bad
    setting or file is one line on stderr and exit code 1."""
    from rollwire.services.core.tiny import tiny_model_of

    # Unset: the built-in tiny model of run.tiny_model's shape, untrained (no warm-up),
    # built before the ranks start (they find it built).
    model_path = Path(config.trainer.model_path or tiny_model_of(config.run.tiny_model))
    rank = become_ranks(config, command, argv)
    try:
        train: list = []
        held: list = []
        report: dict[str, Any] = {}
        steps = 0
        if rank == 0:
            train, held, report = prepare(config, model_path)
            steps = len(
                batches(len(train), section.batch_size, section.epochs, row_seed(config, section))
            )
            steps = min(steps, section.max_steps or steps)
        learner = pipeline_learner(config, model_path, steps, family)
        step = make_step(learner) if make_step is not None else learner
        if learner.followed():
            return 0
        try:
            return lead(config, step, train, held, report, learner.total_updates)
        finally:
            learner.close()
    except (ValueError, FileNotFoundError) as error:
        print(f"rollwire {command}: {error}", file=sys.stderr)
        return 1


def split_data(
    command: str,
    section: Any,
    build: Callable[[Path], tuple[list, Any]],
    what: str,
) -> tuple[list, list, dict[str, Any]]:
    """(training items, held-out items, what building them counted) from `section`'s
    `data` and `eval_data` (or its `held_out_fraction` of `data`, by its `seed`);
    `build(path)` makes the items of one file and their `Counts`."""
    from rollwire.trainer.pipelines.data import held_out_split

    if section.data is None:
        raise ValueError(
            f"rollwire {command} needs {command}.data: a .jsonl or .parquet file, or a folder"
        )
    train, counts = build(section.data)
    report: dict[str, Any] = {"data": counts.summary()}
    if section.eval_data is not None:
        held, held_counts = build(section.eval_data)
        report["eval_data"] = held_counts.summary()
    else:
        train, held = held_out_split(train, section.held_out_fraction, section.seed)
        report["held_out"] = f"{len(held)} of the kept {what} held out"
    if not train:
        raise ValueError(f"{section.data}: nothing left to train on ({counts.summary()})")
    report.update({f"train_{what}": len(train), f"held_out_{what}": len(held)})
    return train, held, report


def pipeline_learner(
    config: RunConfig,
    model_path: Path,
    steps: int,
    family: str = "rollwire.trainer.models.causal_lm:CausalLM",
) -> Any:
    """The `Learner` every rank trains: the trainer section's backend, precision, LoRA
    and optimizer on the model of `family`, its LR schedule over `steps` updates (one a
    step; rank 0's number: the other ranks get it from rank 0). `family`: `module:Class`
    (a pipeline entry's)."""
    from rollwire.trainer.learner import Learner, seed_initialisation
    from rollwire.trainer.models import family_for

    seed_initialisation(config.run.seed)
    learner = Learner(model_path, config.trainer, family_for(family, model_path, config))
    learner.total_updates = int(learner.backend.broadcast_object(steps))
    return learner


def row_seed(config: RunConfig, section: Any) -> int:
    """The seed of a pipeline's row order: its section's `seed` mixed with `run.seed`
    (`rollwire.services.core.seeds`). The held-out split keeps the section's own seed, so
    runs with different seeds are measured on the same rows."""
    from rollwire.services.core.seeds import stream_seed

    return stream_seed(config.run.seed, "data", section.seed)


def batches(count: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Every step's row indices: each epoch a new seeded order, cut into `batch_size`
    (the last batch of an epoch may be smaller)."""
    out = []
    for epoch in range(epochs):
        order = list(range(count))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, count, batch_size)]
    return out


def resume_step(learner: Any, config: RunConfig, run_dir: Path, steps: int) -> int:
    """The step to carry on after: the newest checkpoint's (restored) when
    trainer.checkpointing.resume, else 0."""
    from rollwire.services.core.files import latest_checkpoint

    found = latest_checkpoint(run_dir) if config.trainer.checkpointing.resume else None
    if found is None:
        return 0
    done = int(learner.restore(found)["step"])
    print(f"resumed from {found} (step {done} of {steps})")
    return done


@contextmanager
def metrics_log(run_dir: Path, name: str) -> Iterator[tuple[Path, TextIO]]:
    """`<run_dir>/metrics/<name>.jsonl`, open for appending (a resumed run adds to it)."""
    path = run_dir / "metrics" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        yield path, out


def write_row(out: TextIO, row: dict[str, Any]) -> None:
    """One metrics row, flushed at once."""
    out.write(json.dumps({"time": time.time(), **row}) + "\n")
    out.flush()


def train_steps(
    config: RunConfig,
    learner: Any,
    command: str,
    section: Any,
    count: int,
    steps: int,
    step: Callable[[list[int]], dict[str, float]],
    evaluate: Callable[[], dict[str, float]] | None,
    postfix: Callable[[dict[str, float]], dict[str, str]],
) -> tuple[Path, Path, float]:
    """A pipeline's steps over rows on rank 0: the seeded order of `count` rows (`batches`
    by `section`'s batch_size, epochs and seed), then `run_steps` with `step(rows)` for each
    step's rows. Returns (final model folder, metrics file, seconds)."""
    order = batches(count, section.batch_size, section.epochs, row_seed(config, section))[:steps]
    return run_steps(
        config,
        learner,
        command,
        steps,
        lambda number: step(order[number - 1]),
        evaluate,
        postfix,
        eval_every=section.eval_every,
        checkpoint_every=section.checkpoint_every,
    )


def run_steps(
    config: RunConfig,
    learner: Any,
    command: str,
    steps: int,
    step: Callable[[int], dict[str, float]],
    evaluate: Callable[[], dict[str, float]] | None,
    postfix: Callable[[dict[str, float]], dict[str, str]],
    eval_every: int,
    checkpoint_every: int,
) -> tuple[Path, Path, float]:
    """A pipeline's steps on rank 0: a resume from the newest checkpoint, then `step(number)`
    for each remaining step, `evaluate()` (held-out metrics) before the first, every
    `eval_every` steps and at the end, a metrics row a step in `metrics/<command>.jsonl`,
    checkpoints every `checkpoint_every` steps, a progress bar, and the final model.
    Returns (final model folder, metrics file, seconds)."""
    from tqdm import tqdm

    run_dir = Path(config.run.output_dir)
    done = resume_step(learner, config, run_dir, steps)
    started = time.perf_counter()
    bar = tqdm(
        total=steps, initial=done, desc=command, unit="step", disable=not sys.stderr.isatty()
    )
    with metrics_log(run_dir, command) as (path, out), bar:
        if done == 0 and evaluate is not None:
            write_row(out, {"step": 0, **evaluate()})
        for number in range(done + 1, steps + 1):
            metrics = step(number)
            row: dict[str, Any] = {"step": number, **metrics}
            if evaluate is not None and (
                (eval_every and number % eval_every == 0) or number == steps
            ):
                row.update(evaluate())
            write_row(out, row)
            bar.update(1)
            bar.set_postfix(**postfix(metrics))
            if checkpoint_every and number % checkpoint_every == 0 and number < steps:
                folder = run_dir / "checkpoints" / f"step_{number:06d}"
                learner.save_checkpoint(folder, number, number)
    final = save_final(learner, run_dir, steps)
    return final, path, time.perf_counter() - started


def save_final(learner: Any, run_dir: Path, steps: int) -> Path:
    """The trained model as `<run_dir>/final` (`save_model`)."""
    return save_model(learner, run_dir / "final", steps)


def save_model(learner: Any, folder: Path, steps: int) -> Path:
    """The trained model as `folder`: a Hugging Face folder (LoRA adapters in its
    `adapter/`), without resume state: a model to start from."""
    learner.save_checkpoint(folder, steps, steps)
    (folder / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(folder / "backend", ignore_errors=True)
    return folder


def last_value(path: Path, key: str) -> float | None:
    """The last `key` a metrics file holds, if any."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else None
