"""Names that the config and the trainer's math both use, written down once: the config
validates a YAML file against them, the math's tables are keyed by them (a test checks
the two agree). No imports beyond typing: `rollwire.trainer.math` reads this module.
"""

from __future__ import annotations

from typing import Literal

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
"""How token losses become a loss (`rollwire.trainer.math.losses.AGGREGATIONS`)."""

KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token KL estimators (`rollwire.trainer.math.losses.KL_ESTIMATORS`)."""

ScheduleType = Literal["constant", "linear", "cosine"]
"""Learning-rate shapes after the warm-up (`rollwire.trainer.math.algorithms.SCHEDULES`)."""

PreferenceLoss = Literal["dpo", "ipo", "simpo"]
"""Preference losses (`rollwire.trainer.math.losses.PREFERENCE_LOSSES`)."""

SupervisedLoss = Literal["nll", "forward_kl", "reverse_kl"]
"""`rollwire sft` losses: the likelihood, or a KL of `rollwire.trainer.math.losses.DISTILL_LOSSES`."""

BackendName = Literal["local", "fsdp2", "deepspeed"]
"""Trainer backends (`rollwire.trainer.backends.make_backend`)."""

Dtype = Literal["float32", "bfloat16", "float16"]
"""Precisions a served model runs in."""

LogSync = Literal["batch", "always", "never"]
"""When the buffer's durable log fsyncs (`rollwire.services.buffer.durable_log`)."""
