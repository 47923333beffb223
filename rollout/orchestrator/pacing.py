"""How fast the orchestrator goes: which prompt comes next, how many groups may be in
play, which finished groups are kept, and waiting on a full buffer.

The orchestrator launches a group only while

    groups launched < (trainer version + staleness bound + 1) * groups per step

(`launch_capacity`), so it never produces what the buffer would have to throw
away. A group whose rewards are all equal is dropped (`DynamicSampling`) and
another prompt takes its place. A full buffer slows the orchestrator down to
the trainer's pace instead of losing trajectories
(`put_group_with_backpressure`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rollwire.services.buffer.protocol import PutAnswer
from rollwire.services.core.datasets import Task
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, TryAgain, call_with_retries
from rollwire.services.core.wire import Trajectory


class PromptQueue:
    """The prompts to run, in order: those to run again first (a group that failed, or
    one an earlier orchestrator left unfinished), then fresh ones."""

    def __init__(self, again: Iterable[Task], fresh: Iterator[Task]) -> None:
        self._again = deque(again)
        self._fresh = fresh

    def next(self) -> Task:
        return self._again.popleft() if self._again else next(self._fresh)

    def run_again(self, task: Task) -> None:
        """`task` comes back before any fresh prompt."""
        self._again.append(task)


def launch_capacity(
    trainer_version: int, staleness: int, per_step: int, total_steps: int, dropped_groups: int
) -> int:
    """Groups that may have been launched by now.

    Enough for the steps up to `staleness` versions ahead of the trainer, never
    more than the run needs; groups the buffer dropped as too stale (a slow
    episode can outlive the bound) are made up for, or the trainer would wait
    for groups that never come.
    """
    ahead = (trainer_version + staleness + 1) * per_step
    return min(ahead, (total_steps + 1) * per_step) + dropped_groups


class DynamicSampling:
    """Drops groups whose rewards are all equal, which give group-relative advantages
    nothing to learn from; the orchestrator samples another prompt in each one's place.

    At most `per_step` groups are dropped per policy version, so a run where every
    group is uniform (all solved, all failed) still moves.
    """

    def __init__(self, enabled: bool, per_step: int) -> None:
        self.enabled, self.per_step = enabled, per_step
        self._dropped: dict[int, int] = {}

    def drops(self, rewards: Sequence[float], version: int) -> bool:
        """Whether the group with these rewards, finished at `version`, is dropped."""
        if not self.enabled or len(set(rewards)) > 1:
            return False
        dropped = self._dropped.get(version, 0)
        if dropped >= self.per_step:
            COUNTERS.inc("orchestrator_uniform_groups_kept")
            return False
        self._dropped[version] = dropped + 1
        COUNTERS.inc("orchestrator_groups_filtered", reward=str(rewards[0]))
        return True


def _backpressure(timeout: float) -> RetryPolicy:
    # Short pauses at first, doubling up to a second: the producer keeps to the trainer's
    # pace without polling a full buffer hard.
    return RetryPolicy(
        attempts=None, first_pause=0.05, multiplier=2.0, max_pause=1.0, total_seconds=timeout
    )


def _never(_: BaseException) -> bool:
    return False  # a put that failed outright (the buffer is gone) is the caller's to handle


def _count_wait(reason: str) -> None:
    COUNTERS.inc("orchestrator_backpressure_waits", reason=reason.split(":")[0])


async def put_group_with_backpressure(
    producer: Any, trajectories: list[Trajectory], timeout: float
) -> list[PutAnswer]:
    """Puts a group in one message, waiting while the buffer is full rather than dropping
    anything.

    A full buffer means the trainer is behind; the producer slows down to its
    pace. A buffer that cannot write its log (reason "storage: ...") is waited
    for the same way. The trajectories refused for either reason are sent
    again (the others are not); past `timeout` a TimeoutError (the group is
    then counted as failed) instead of hanging."""
    answers: list[Any] = [None] * len(trajectories)
    pending = list(range(len(trajectories)))
    waiting_for: str | None = None  # why the last put has to be sent again, if it has

    async def put_pending() -> list[PutAnswer]:
        nonlocal pending, waiting_for
        waiting_for = None
        acks = await producer.put_group([trajectories[i] for i in pending])
        for index, ack in zip(pending, acks, strict=True):
            answers[index] = ack
        pending = [i for i in pending if answers[i].wait_and_retry]
        if pending:
            waiting_for = answers[pending[0]].reason
            raise TryAgain(waiting_for)
        return answers

    try:
        return await call_with_retries(
            put_pending,
            _backpressure(timeout),
            what="put_group",
            retryable=_never,
            on_retry=lambda refused, _attempt: _count_wait(str(refused)),
        )
    except TimeoutError:
        if waiting_for is None:  # the put itself timed out: not the buffer being full
            raise
        _count_wait(waiting_for)  # the refusal the deadline cut short is a wait too
        raise TimeoutError(
            f"the buffer did not take a group for {timeout:g}s: {waiting_for}"
        ) from None
