"""What a training run writes down as it goes: its metrics, what it trained, its clock."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rollwire.trainer.servicer import TrainerState

log = logging.getLogger(__name__)


class MetricsLog:
    """Metrics as JSON lines and, when tensorboard is installed, TensorBoard events."""

    def __init__(self, run_dir: Path) -> None:
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics" / "trainer.jsonl").open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            log.warning("tensorboard is not installed; metrics go to JSON lines only")
            self._board = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics, flushed at once (a killed trainer loses no step)."""
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in metrics.items():
                self._board.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


def open_trained_log(run_dir: Path, state: TrainerState) -> TextIO:
    """The record of what was trained, batch by batch (the one exactly-once accounting
    checks), open for appending. A restart from a checkpoint is written down too: the
    steps after it happen again."""
    trained_path = run_dir / "metrics" / "trained_ids.jsonl"
    restarted = trained_path.exists() and trained_path.stat().st_size > 0
    trained_log = trained_path.open("a")
    if restarted:  # a trainer before this one wrote here: its steps after ours are undone
        trained_log.write(
            json.dumps({"resumed_from_step": state.step, "policy_version": state.version}) + "\n"
        )
        trained_log.flush()
    return trained_log


class Clock:
    """Wall time of this trainer and the part of it spent waiting for batches."""

    def __init__(self) -> None:
        self.started, self.idle = time.perf_counter(), 0.0

    def rates(self, state: TrainerState) -> dict[str, float]:
        """The metrics every step adds: version, idle fraction, throughput, elapsed time."""
        elapsed = time.perf_counter() - self.started
        return {
            "policy_version": float(state.version),
            "trainer_idle_fraction": self.idle / elapsed,
            "trajectories_per_second": state.trained / elapsed,
            "elapsed_seconds": elapsed,
        }
