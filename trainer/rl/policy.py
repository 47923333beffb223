"""What the trainer process trains: a learner with the RL step on it.

    policy = Policy(model_path, config.trainer, config.rl)
    metrics = policy.train_step(trajectories, version)   # collective over the ranks
    policy.named_weights()                               # what goes to the rollout-servers

The learner (trainer/learner.py) holds the model, its optimizer, ranks and checkpoints;
the step (trainer/rl/step.py) holds what RL adds (reference, critic, advantages). The
methods below are the learner's and the step's, named for the trainer loop. Another
family and step may be given: a run's pipeline names them (the trainer process's
`policy_of`: Flow-GRPO's step on a flow denoiser for a diffusion run).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.learner import Learner
from rollwire.trainer.models import ModelFamily
from rollwire.trainer.rl.step import RLStep


class Policy:
    """A `Learner` and its `RLStep` (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        config: TrainerConfig,
        rl: RLSection,
        family: ModelFamily | None = None,
        step: type | None = None,
    ) -> None:
        self.learner = Learner(model_path, config, family)
        self.step = (step or RLStep)(self.learner, config, rl)

    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        """One step of the pipeline's (`RLStep.train_step`, `FlowGRPOStep.train_step`)."""
        return self.step.train_step(trajectories, trainer_version)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights to publish (`Learner.named_weights`)."""
        return self.learner.named_weights()

    def named_adapters(self) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        """A LoRA run's adapted layers (`Learner.named_adapters`)."""
        return self.learner.named_adapters()

    def weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """The weights to publish while the next step runs (`Learner.weights_snapshot`)."""
        return self.learner.weights_snapshot()

    def save_checkpoint(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """A checkpoint with the step's state (`Learner.save_checkpoint`)."""
        return self.learner.save_checkpoint(folder, step, version, extra)

    def checkpoint_writer(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Callable[[], Path] | None:
        """A checkpoint written while the next steps run (`Learner.checkpoint_writer`)."""
        return self.learner.checkpoint_writer(folder, step, version, extra)

    def restore(self, folder: str | Path) -> dict[str, Any]:
        """Back to a checkpoint (`Learner.restore`); its trainer state."""
        return self.learner.restore(folder)

    def heartbeat(self) -> None:
        """Rank 0 while it waits (`Learner.heartbeat`)."""
        self.learner.heartbeat()

    def set_threads(self, threads: int) -> str | None:
        """`Learner.set_threads`."""
        return self.learner.set_threads(threads)

    def followed(self) -> bool:
        """`Learner.followed`: True on the ranks that followed rank 0 to its end."""
        return self.learner.followed()

    def close(self) -> None:
        """`Learner.close`."""
        self.learner.close()
