"""What a training run writes down as it goes: its metrics, what it trained, its clock."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rollwire.services.core.config import RunConfig
    from rollwire.trainer.process.servicer import TrainerState

log = logging.getLogger(__name__)


class MetricsLog:
    """Metrics as JSON lines, and to each of `telemetry.trackers` (TensorBoard, W&B)."""

    def __init__(self, run_dir: Path, config: RunConfig | None = None) -> None:
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics" / "trainer.jsonl").open("a")
        trackers = ["tensorboard"] if config is None else config.telemetry.trackers
        self._board = None
        self._wandb = None
        if "tensorboard" in trackers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._board = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; metrics go to JSON lines only")
        if "wandb" in trackers and config is not None:
            self._wandb = _start_wandb(run_dir, config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics, flushed at once (a killed trainer loses no step)."""
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in metrics.items():
                self._board.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{key}": value for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(run_dir: Path, config: RunConfig) -> Any:
    """A W&B run in `<run>/wandb` (offline unless `telemetry.wandb_mode: online`), with
    the run's resolved configuration; a resumed trainer continues the same W&B run."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "telemetry.trackers names wandb, which is not installed: pip install wandb"
        ) from None
    telemetry = config.telemetry
    folder = run_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    # One id per run folder, so a restarted trainer appends to the run it began.
    id_file = folder / "rollwire-run-id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:8])
    return wandb.init(
        project=telemetry.wandb_project,
        name=config.run.name,
        id=id_file.read_text().strip(),
        resume="allow",
        dir=str(run_dir),
        mode=telemetry.wandb_mode,
        config=config.model_dump(mode="json"),
        settings=wandb.Settings(silent=True, console="off"),
    )


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
