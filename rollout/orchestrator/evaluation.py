"""Held-out evaluation: the policy's greedy reward on tasks it never trains on.

The orchestrator evaluates once in every `orchestrator.eval_every` policy versions:
the first version it sees at or past each multiple (version 0 included; a fast trainer
can move past a multiple between two looks, and then the next version stands for it),
and once more when the trainer reaches `rl.max_steps`, each version at most once. An
orchestrator that starts mid-window (a resumed run) waits for the next multiple. The mean reward goes to metrics/eval.jsonl. An
evaluation that meets a restarting service is tried again a few times, then
skipped and counted: it must never end the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

import grpc.aio
import numpy as np

from rollwire.services.core.datasets import Task
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, call_with_retries
from rollwire.services.core.watchdog import Watchdog

log = logging.getLogger(__name__)

# Three tries, 2 s then 4 s apart: long enough for a restarted service to come back.
PATIENCE = RetryPolicy(attempts=3, first_pause=2.0, multiplier=2.0, max_pause=4.0)
# After the last failure the orchestrator still pauses before it goes on: the service
# that failed is likely still coming back, and the run's next calls would meet it first.
GIVE_UP_PAUSE = 6.0


def _worth_another_try(error: BaseException) -> bool:
    # A service restarting, a connection lost, an episode that could not finish.
    return isinstance(error, grpc.aio.AioRpcError | OSError | RuntimeError)


class Evaluation:
    """Evaluates the policy on held-out `tasks` when due; `reward_of(task)` plays one
    task greedily and returns its reward (None for a subclass with its own `evaluate`)."""

    def __init__(
        self,
        tasks: Sequence[Task],
        reward_of: Callable[[Task], Awaitable[float]] | None,
        *,
        every: int,
        final_step: int,
        concurrency: int,
        log_file: IO[str],
        watchdog: Watchdog,
        watch_seconds: float,
    ) -> None:
        self.tasks, self.reward_of = tasks, reward_of
        self.every, self.final_step = every, final_step
        self.concurrency = concurrency
        self.log_file = log_file
        self.watchdog, self.watch_seconds = watchdog, watch_seconds
        self.evaluated: set[int] = set()
        self.window: int | None = None
        """`version // every` of the last window evaluated (None before the first look)."""

    def due(self, version: int, step: int) -> bool:
        """Whether policy `version` (the trainer at `step`) is still to be evaluated."""
        if not self.tasks or version in self.evaluated:
            return False
        window = version // self.every
        if self.window is None and version % self.every:
            self.window = window  # started mid-window: this one was evaluated before
        return step >= self.final_step or self.window is None or window > self.window

    async def when_due(self, version: int, step: int) -> None:
        """Evaluates `version` if it is due (see `due`), patiently."""
        if self.due(version, step):
            self.evaluated.add(version)
            self.window = version // self.every
            await self.patiently(version)

    async def patiently(self, version: int) -> None:
        """An evaluation that meets a restarting service is tried again a few times, then
        skipped (counted): it must not end the run."""

        async def watched() -> float:
            with self.watchdog.watch("evaluation", f"of version {version}", self.watch_seconds):
                return await self.evaluate(version)

        def failed(error: BaseException, attempt: int) -> None:
            COUNTERS.inc("orchestrator_eval_failures")
            log.warning(
                "evaluation failed",
                extra={"policy_version": version, "attempt": attempt, "error": str(error)},
            )

        try:
            await call_with_retries(
                watched,
                PATIENCE,
                what=f"evaluation of version {version}",
                retryable=_worth_another_try,
                on_retry=failed,
            )
        except Exception as error:
            if not _worth_another_try(error):
                raise
            failed(error, PATIENCE.attempts)
            await asyncio.sleep(GIVE_UP_PAUSE)
            log.error("evaluation of version %d skipped after 3 failures", version)

    async def evaluate(self, version: int) -> float:
        """Greedy accuracy on the held-out tasks; logged to metrics/eval.jsonl."""
        # As many requests in flight as training keeps, no more.
        limit = asyncio.Semaphore(self.concurrency)

        reward_of = self.reward_of
        assert reward_of is not None, "an Evaluation without reward_of evaluates its own way"

        async def one(task: Task) -> float:
            async with limit:
                return await reward_of(task)

        rewards = await asyncio.gather(*(one(t) for t in self.tasks))
        mean = float(np.mean(rewards))
        entry = {
            "policy_version": version,
            "eval_reward": mean,
            "tasks": len(self.tasks),
            "time": time.time(),
        }
        self.log_file.write(json.dumps(entry) + "\n")
        self.log_file.flush()
        log.info("evaluated", extra={"policy_version": version, "eval_reward": round(mean, 4)})
        return mean


async def measure(
    tasks: Sequence[Task],
    greedy_of: Callable[[Task], Awaitable[float]],
    samples_of: Callable[[Task, int], Awaitable[list[float]]],
    *,
    samples: int,
    correct_at: float,
    concurrency: int,
) -> dict[str, float]:
    """Held-out numbers of one model: `greedy_reward` (what training's evaluation logs)
    and, when `samples` > 0, from that many sampled responses per task, `pass@1` (the
    expected fraction correct of one sample) and `pass@{samples}` (the fraction of tasks
    with at least one correct); a response is correct at reward >= `correct_at`."""
    limit = asyncio.Semaphore(concurrency)

    async def bounded(call: Awaitable[Any]) -> Any:
        async with limit:
            return await call

    greedy = await asyncio.gather(*(bounded(greedy_of(task)) for task in tasks))
    out = {"tasks": float(len(tasks)), "greedy_reward": float(np.mean(greedy)) if greedy else 0.0}
    if samples > 0 and tasks:
        sampled = await asyncio.gather(*(bounded(samples_of(task, samples)) for task in tasks))
        correct = np.array([[r >= correct_at for r in rewards] for rewards in sampled], float)
        out["sampled_reward"] = float(np.mean(sampled))
        out["pass@1"] = float(correct.mean())
        out[f"pass@{samples}"] = float(correct.max(axis=1).mean())
    return out
