"""An episode's tokens as they grow, and the trajectory made of them.

Both kinds of episode end here: a single response to a prompt (the
orchestrator's `sample_group`) and a multi-turn episode against an env
(`agent.EpisodeRunner`). Each collects its tokens in an `EpisodeTokens` and
hands them to `trajectory_from_episode`, so the two can never disagree on how
a trajectory is laid out: ids, dtypes, the loss mask, which tokens carry
logprobs and policy versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rollwire.proto.v1 import rollout_pb2
from rollwire.services.core.datasets import Task
from rollwire.services.core.images import ImageRef
from rollwire.services.core.wire import Trajectory


@dataclass
class EpisodeTokens:
    """The token sequence of one episode, with what the trainer needs per token."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)
    """The images shown so far, each with its offset in `ids`."""

    def context(self, ids: list[int], images: Sequence[ImageRef] = ()) -> None:
        """Appends tokens the policy did not generate (the prompt, an observation):
        no loss on them, no logprob, no policy version, no turn. `images`: those the
        tokens show, their offsets counted within `ids`."""
        self.images += [image.with_offset(len(self.ids) + image.offset) for image in images]
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.turns += [-1] * len(ids)

    def generated(self, output: rollout_pb2.GenerateResponse, turn: int) -> None:
        """Appends what the engine generated in `turn`, with its logprobs and versions."""
        n = len(output.token_ids)
        self.ids += list(output.token_ids)
        self.mask += [1] * n
        self.logprobs += list(output.logprobs)
        self.versions += list(output.policy_versions)
        self.turns += [turn] * n


def finish_reason_of(output: rollout_pb2.GenerateResponse) -> str:
    """The engine's finish reason as a trajectory names it ("stop", "length", ...)."""
    return (
        rollout_pb2.FinishReason.Name(output.finish_reason).removeprefix("FINISH_REASON_").lower()
    )


def trajectory_from_episode(
    task: Task,
    sample_index: int,
    tokens: EpisodeTokens,
    *,
    reward: float,
    reward_components: dict[str, float],
    finish_reason: str,
    timings: dict[str, float],
    source: str | None = None,
    domain: str | None = None,
    step_rewards: Sequence[float] | None = None,
    turn_keys: Sequence[str] | None = None,
) -> Trajectory:
    """Sample `sample_index` of `task`'s group as the trajectory the buffer takes.

    `source` and `domain` default to the task's (an env episode names its env's).
    A multi-turn episode passes its `step_rewards` and `turn_keys`, and then its
    tokens' turn ids go along; a single response has none of the three (the
    wire's empty arrays say "single-turn").
    """
    multi_turn = step_rewards is not None
    return Trajectory(
        trajectory_id=f"{task.task_id}/{sample_index}",
        group_id=task.task_id,
        task_id=task.task_id,
        sample_index=sample_index,
        prompt_ordinal=task.ordinal,
        source=task.source if source is None else source,
        domain=task.domain if domain is None else domain,
        token_ids=np.asarray(tokens.ids, np.int32),
        loss_mask=np.asarray(tokens.mask, np.uint8),
        behaviour_logprobs=np.asarray(tokens.logprobs, np.float32),
        policy_versions=np.asarray(tokens.versions, np.int64),
        reward=reward,
        reward_components=reward_components,
        step_rewards=np.asarray(step_rewards if multi_turn else [], np.float32),
        turn_ids=np.asarray(tokens.turns if multi_turn else [], np.int32),
        turn_keys=list(turn_keys or []),
        finish_reason=finish_reason,
        timings=timings,
        images=list(tokens.images),
    )
