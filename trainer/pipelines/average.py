"""An exponential moving average of a learner's weights, as the distillation pipelines keep
one beside the model they train (`ode_distill.ema_decay`, `dmd.ema_decay`): updated after
each optimizer step, sampled from in the model's place, saved in every checkpoint and
restored on resume, and written as a model folder of its own at the end (`final_ema`).

It averages the full weights of one process's model, so it needs the local backend on one
rank and no LoRA (an average of adapters merged into a base is another thing); the
pipeline's section names the setting in the error.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rollwire.trainer.learner import Learner


class WeightAverage:
    """`decay` times the average plus (1 - decay) times the learner's weights, each step."""

    def __init__(self, learner: Learner, decay: float, setting: str) -> None:
        if learner.sharded:
            raise ValueError(
                f"{setting} averages one process's weights: trainer.backend must be local "
                "and trainer.world_size 1"
            )
        if learner.config.lora is not None:
            raise ValueError(f"{setting} averages full weights: unset it or trainer.lora")
        self.learner, self.decay = learner, decay
        self.model: Any = copy.deepcopy(learner.model).eval().requires_grad_(False)

    def update(self) -> None:
        """The average moved toward the learner's weights (`diffusion.distill.ema_update`)."""
        from rollwire.diffusion.distill import ema_update

        ema_update(self.model, self.learner.model, self.decay)

    def save(self, folder: Path) -> Path:
        """The average as a model folder the learner's family loads."""
        self.model.save_pretrained(folder)
        self.learner.family.save_extras(self.learner.model_path, folder)
        return folder

    def load(self, folder: Path) -> None:
        """The average saved in `folder` by `save`."""
        self.model.load_state_dict(self.learner.family.load_weights(folder))
