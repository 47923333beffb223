"""The model families the trainer trains (`ModelFamily`, models/base.py): the causal LM
(models/causal_lm.py), the sequence scorer of reward models (models/sequence_score.py)
and the class-conditional flow-matching denoiser (models/flow_denoiser.py).

A new kind of model is one file here; the pipeline that trains it names it in its entry
of the pipeline table (trainer/pipelines/table.py). The learner, the backends and the
checkpoints take it as it is.
"""

from __future__ import annotations

from rollwire.trainer.models.base import ModelFamily
from rollwire.trainer.models.causal_lm import CausalLM

__all__ = ["CausalLM", "ModelFamily"]
