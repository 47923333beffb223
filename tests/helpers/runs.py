"""`rollwire` commands run as real processes by the tests, and what they leave to read.

Every command here runs in its own process session with one torch thread, and takes its
models from the test session's cache (`ROLLWIRE_CACHE_DIR`, set once for the session by
tests/conftest.py): the built-in tiny models and their warm-ups are keyed by everything
that makes them, so tests that start from the same one build it once between them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ROLLWIRE = [sys.executable, "-m", "rollwire.services.app.cli"]

SHORT_RUN = [
    "rl.max_steps=4",
    "rl.groups_per_step=4",
    "rl.group_size=4",
    "rl.max_staleness=1",
    "warmup.steps=20",
    "orchestrator.eval_every=2",
    "orchestrator.eval_dataset.size=16",
    "run.tiny_model={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2}",
]
"""A few asynchronous steps of a very small model: enough to see every process work."""

GUESS_RUN = [
    "orchestrator.dataset={type: env, env_id: guess_the_number, env_kwargs: {low: 1, high: 8}}",
    "orchestrator.eval_dataset={type: env, env_id: guess_the_number, "
    "env_kwargs: {low: 1, high: 8}, seed: 100000, size: 8}",
    "orchestrator.agent.max_turns=4",
    "orchestrator.agent.max_episode_tokens=200",
    "orchestrator.max_new_tokens=4",
    "orchestrator.eval_every=2",
    "rl.groups_per_step=4",
    "rl.group_size=4",
    "warmup.steps=10",
    "run.tiny_model={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2}",
]
"""A short agentic run: guess the number in four turns."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a `rollwire` child: this one, one torch thread, and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def command_line(name: str, *sets: str, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`rollwire NAME [extra] --set ...`."""
    args = [*ROLLWIRE, name, *extra]
    for item in sets:
        args += ["--set", item]
    return args


def train_command(run_dir: Path, *overrides: str, config: Path | None = None) -> list[str]:
    """`rollwire train [-c config] --set run.output_dir=run_dir --set ...`."""
    extra = ["-c", str(config)] if config is not None else []
    return command_line("train", f"run.output_dir={run_dir}", *overrides, extra=extra)


def rollwire_train(
    tmp_path: Path, *overrides: str, timeout: float = 540, config: Path | None = None
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Runs `rollwire train` in its own session; returns (run dir, result)."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        train_command(run_dir, *overrides, config=config),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        start_new_session=True,
    )
    return run_dir, result


def rollwire(tmp_path: Path, command: str, *sets: str, timeout: float = 300, extra=()) -> str:
    """`rollwire COMMAND [extra] --set ...`, which must succeed; its standard output."""
    done = subprocess.run(
        command_line(command, *sets, extra=extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        start_new_session=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (the run's unique folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def assert_no_process_left(run_dir: Path) -> None:
    deadline = time.monotonic() + 10
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == []


def chain_sum_files(folder: Path, off_by_one: float = 0.0, rows: int | None = None) -> Path:
    """examples/chain_sum_data.py's files in `folder` (sft.jsonl, pairs.jsonl): the default
    task, none of the evaluation set; `rows` keeps only the first of each."""
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "chain_sum_data.py"),
            str(folder),
            "--off-by-one",
            str(off_by_one),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    if rows is not None:
        for name in ("sft.jsonl", "pairs.jsonl"):
            path = folder / name
            path.write_text("".join(path.read_text().splitlines(keepends=True)[:rows]))
    return folder


def fine_tune(tmp_path: Path, folder: Path, data: Path, *sets: str, evaluate: bool = False):
    """`rollwire sft` on `data` into `folder` (8 epochs at rate 3e-3, as the distillation
    tests' teachers and students train), and with `evaluate` the held-out report of
    its final model (`rollwire eval`)."""
    rollwire(
        tmp_path,
        "sft",
        f"run.output_dir={folder}",
        f"sft.data={data}",
        "sft.epochs=8",
        "trainer.optimizer.learning_rate=0.003",
        *sets,
    )
    if not evaluate:
        return folder / "final"
    rollwire(
        tmp_path, "eval", f"run.output_dir={folder}", extra=["--checkpoint", str(folder / "final")]
    )
    return json.loads((folder / "evals" / "final" / "eval.json").read_text())
