"""A diffusion sample as the buffer carries it: a latent trajectory (`kind: latents`).

Each recorded SDE step is one generated "token": its step index in `token_ids`, 1 in
`loss_mask`, its log-probability under the sampling weights in `behaviour_logprobs` and
the version that took it in `policy_versions`; `tensors` holds `latents` (float32
[R + 1, C, H, W]: before each step, then after the last), `label` (int64 [1]) and
`sampling` (float64 [4]: steps, eta, shift, guidance), everything the trainer needs to
recompute the steps' log-probabilities (`rollwire.trainer.rl.flow_grpo`), and `scoring`
(the task's reference and metadata as UTF-8 JSON bytes, uint8), what reward feedback
learning needs to score its own image of the sample (`rollwire.trainer.rl.reward_fl`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rollwire.diffusion.sampling import SamplingSettings
from rollwire.services.core.wire import Trajectory

SAMPLING_KEYS = ("steps", "eta", "shift", "guidance")
"""What `tensors["sampling"]` holds, in order."""


def sampling_tensor(settings: SamplingSettings) -> np.ndarray:
    """`tensors["sampling"]` of a sample drawn with `settings`."""
    return np.array([getattr(settings, key) for key in SAMPLING_KEYS], dtype=np.float64)


def scoring_tensor(reference: str, metadata: dict[str, Any]) -> np.ndarray:
    """`tensors["scoring"]`: how the sample's task is scored, as JSON bytes."""
    text = json.dumps({"reference": reference, "metadata": metadata}, sort_keys=True)
    return np.frombuffer(text.encode(), dtype=np.uint8).copy()


def scoring_of(tensor: np.ndarray) -> tuple[str, dict[str, Any]]:
    """(reference, metadata) of a `scoring` tensor."""
    scoring = json.loads(np.asarray(tensor, np.uint8).tobytes().decode())
    return str(scoring["reference"]), dict(scoring["metadata"])


def latent_trajectory(
    sample: Any,
    *,
    trajectory_id: str,
    group_id: str,
    sample_index: int,
    prompt_ordinal: int,
    task_id: str,
    source: str,
    domain: str,
    settings: SamplingSettings,
    reward: float,
    reward_components: dict[str, float] | None = None,
    latents: np.ndarray | None = None,
    scoring: np.ndarray | None = None,
) -> Trajectory:
    """The Trajectory of one sample (see the module docstring): `sample` is what an engine
    answered (its `recorded_steps`, `logprobs`, `policy_versions`, `label` and, unless
    `latents` is given, `latents`: an `ImageGeneration`, or an `ImageSample` with its
    latents decoded); `scoring` (`scoring_tensor`) is kept when given."""
    latents = np.asarray(sample.latents if latents is None else latents, np.float32)
    steps = len(sample.recorded_steps)
    if not (len(sample.logprobs) == len(sample.policy_versions) == steps == len(latents) - 1):
        raise ValueError(
            f"{steps} recorded steps, {len(sample.logprobs)} log-probabilities, "
            f"{len(sample.policy_versions)} versions and {len(latents)} latents "
            "(steps + 1 expected)"
        )
    return Trajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        task_id=task_id,
        sample_index=sample_index,
        prompt_ordinal=prompt_ordinal,
        source=source,
        domain=domain,
        token_ids=np.asarray(list(sample.recorded_steps), np.int32),
        loss_mask=np.ones(steps, np.uint8),
        behaviour_logprobs=np.asarray(list(sample.logprobs), np.float32),
        policy_versions=np.asarray(list(sample.policy_versions), np.int64),
        reward=float(reward),
        reward_components=dict(reward_components or {}),
        kind="latents",
        tensors={
            "latents": latents,
            "label": np.array([sample.label], np.int64),
            "sampling": sampling_tensor(settings),
            **({} if scoring is None else {"scoring": scoring}),
        },
    )
