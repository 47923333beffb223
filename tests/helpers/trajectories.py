"""Trajectories made by hand for the buffer, the trainer step and the wire."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np

from rollwire.services.core.wire import Trajectory

PROMPT = [20, 3, 14, 3, 21, 3, 32]
# Four responses of different lengths (so packing has something to do), one group.
RESPONSES = [[99, 22, 100, 1], [99, 23, 1], [99, 22, 100, 24, 25, 1], [40, 1]]
REWARDS = [1.0, 0.0, 1.0, 0.0]

_ORDINALS: dict[str, int] = {}


def tokens(
    ids: list[int],
    mask: list[int],
    index: int = 0,
    reward: float = 0.0,
    version: int = 0,
    group_id: str = "g",
    ordinal: int = 0,
) -> Trajectory:
    """Sample `index` of `group_id` with these token ids and loss mask; behaviour logprobs
    all 0 (a fixed, off-policy mu), generated tokens of policy `version`."""
    loss = np.array(mask, np.uint8)
    return Trajectory(
        trajectory_id=f"{group_id}{index}",
        group_id=group_id,
        task_id=group_id,
        sample_index=index,
        prompt_ordinal=ordinal,
        source="test",
        domain="test",
        token_ids=np.array(ids, np.int32),
        loss_mask=loss,
        behaviour_logprobs=np.zeros(len(ids), np.float32),
        policy_versions=np.where(loss == 1, version, -1).astype(np.int64),
        reward=reward,
    )


def group(rewards: list[float] = REWARDS, version: int = 0) -> list[Trajectory]:
    """One group of RESPONSES to PROMPT (`tokens`), trajectory ids t0, t1, ..."""
    out = []
    for index, (response, reward) in enumerate(zip(RESPONSES, rewards, strict=True)):
        mask = [0] * len(PROMPT) + [1] * len(response)
        sample = tokens(PROMPT + response, mask, index, reward, version)
        sample.trajectory_id = f"t{index}"
        out.append(sample)
    return out


def trajectory(
    group: str, index: int, version: int = 0, reward: float = 0.0, ordinal: int | None = None
) -> Trajectory:
    """One sample of `group`; each group name gets its own prompt ordinal, as in a run."""
    if ordinal is None:
        ordinal = _ORDINALS.setdefault(group, len(_ORDINALS))
    mask = np.array([0, 0, 1, 1], np.uint8)
    return Trajectory(
        trajectory_id=f"{group}/{index}",
        group_id=group,
        task_id=group,
        sample_index=index,
        prompt_ordinal=ordinal,
        source="test",
        domain="math",
        token_ids=np.array([1, 2, 3, 4], np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32),
        policy_versions=np.where(mask == 1, version, -1).astype(np.int64),
        reward=reward,
    )


def latent_trajectory(group: str, index: int, versions: tuple[int, ...] = (0, 0, 1)) -> Trajectory:
    """A diffusion sample of `group` as the buffer carries it
    (`rollwire.diffusion.trajectories`): one "token" per recorded denoising step, the
    latents before each step and after the last in `tensors`."""
    from rollwire.diffusion.sampling import SamplingSettings
    from rollwire.diffusion.trajectories import latent_trajectory as made

    rng = np.random.default_rng(zlib.crc32(f"{group}/{index}".encode()))
    steps = len(versions)
    sampled = SimpleNamespace(
        recorded_steps=range(2, 2 + steps),
        logprobs=rng.normal(-60, 5, steps),
        policy_versions=versions,
        latents=rng.standard_normal((steps + 1, 1, 8, 8)),
        label=10,
    )
    return made(
        sampled,
        trajectory_id=f"{group}/{index}",
        group_id=group,
        sample_index=index,
        prompt_ordinal=_ORDINALS.setdefault(group, len(_ORDINALS)),
        task_id=group,
        source="test",
        domain="digit",
        settings=SamplingSettings(steps=10, eta=0.7, sde_window=(2, 2 + steps)),
        reward=0.0,
    )


def sequence(
    prompt: list[int],
    generated: list[int],
    *,
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    images: list | None = None,
    reward: float = 0.0,
    index: int = 0,
) -> Trajectory:
    """A prompt and what was generated after it as one trajectory (logprobs 0 and version
    0 unless given), showing `images` (a vision-language prompt)."""
    return Trajectory(
        trajectory_id=f"t{index}",
        group_id="g",
        task_id="x",
        sample_index=index,
        prompt_ordinal=0,
        source="test",
        domain="test",
        token_ids=np.array(prompt + generated, np.int32),
        loss_mask=np.array([0] * len(prompt) + [1] * len(generated), np.uint8),
        behaviour_logprobs=np.array(
            [0.0] * len(prompt) + list(logprobs or [0.0] * len(generated)), np.float32
        ),
        policy_versions=np.array(
            [-1] * len(prompt) + list(versions or [0] * len(generated)), np.int64
        ),
        reward=reward,
        images=list(images or []),
    )
