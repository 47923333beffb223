"""The model families the trainer trains (`ModelFamily`, models/base.py): the causal LM
(models/causal_lm.py), the vision-language model (models/vision_lm.py), the sequence
scorer of reward models (models/sequence_score.py) and the class-conditional
flow-matching denoiser (models/flow_denoiser.py).

A new kind of model is one file here; the pipeline that trains it names it in its entry
of the pipeline table (trainer/pipelines/table.py). The learner, the backends and the
checkpoints take it as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollwire.trainer.models.base import ModelFamily
from rollwire.trainer.models.causal_lm import CausalLM

__all__ = ["CausalLM", "ModelFamily", "family_for"]


def family_for(spec: str, model_path: str | Path, config: Any = None) -> ModelFamily:
    """The family a pipeline entry names (`module:Class`) for the model at `model_path`:
    a pipeline that trains causal LMs trains a vision-language model folder (one whose
    config has a vision part) as one, so every text pipeline takes such models. `config`:
    the run's RunConfig, for the image limits and `trainer.freeze`."""
    import importlib

    from rollwire.services.core.vision import is_vision_model

    module, _, name = spec.partition(":")
    kind = getattr(importlib.import_module(module), name)
    if kind is CausalLM and is_vision_model(model_path):
        from rollwire.trainer.models.vision_lm import VisionLM

        family: ModelFamily = VisionLM(config.image_inputs.limits() if config else None)
    else:
        family = kind()
    if config is not None:
        family.frozen = tuple(config.trainer.freeze)
    return family
