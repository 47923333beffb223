"""`rollwire eval`'s numbers (`rollout/orchestrator/evaluation.measure`) on scripted rewards
(the command itself runs at the end of tests/runs/test_train.py's short run), and which
versions the orchestrator's held-out evaluation takes."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.rollout.orchestrator.evaluation import Evaluation, measure
from rollwire.services.core.datasets import Task

TASKS = [Task(i, f"t{i}", f"q{i}", "1", "math", "test") for i in range(4)]
# Per task: the greedy reward and four sampled ones.
GREEDY = {"t0": 1.0, "t1": 0.0, "t2": 0.0, "t3": 1.0}
SAMPLED = {
    "t0": [1.0, 1.0, 0.0, 1.0],
    "t1": [0.0, 0.0, 0.0, 0.0],
    "t2": [0.0, 0.5, 0.0, 1.0],  # one partial reward: not correct at 1.0
    "t3": [1.0, 1.0, 1.0, 1.0],
}


def numbers(samples: int, correct_at: float = 1.0) -> dict[str, float]:
    async def greedy(task: Task) -> float:
        return GREEDY[task.task_id]

    async def sampled(task: Task, k: int) -> list[float]:
        return SAMPLED[task.task_id][:k]

    return asyncio.run(
        measure(TASKS, greedy, sampled, samples=samples, correct_at=correct_at, concurrency=2)
    )


def test_greedy_reward_alone_without_samples() -> None:
    assert numbers(0) == {"tasks": 4.0, "greedy_reward": 0.5}


def test_pass_at_k_counts_tasks_with_one_correct_sample() -> None:
    out = numbers(4)
    assert out["greedy_reward"] == 0.5
    assert out["sampled_reward"] == pytest.approx(8.5 / 16)
    assert out["pass@1"] == pytest.approx(8 / 16)  # correct samples over all samples
    assert out["pass@4"] == pytest.approx(3 / 4)  # t0, t2, t3 have a correct one
    # A lower bar counts the partial reward as correct.
    assert numbers(4, correct_at=0.5)["pass@1"] == pytest.approx(9 / 16)
    assert numbers(2)["pass@2"] == pytest.approx(2 / 4)  # t0 and t3 in their first two


def evaluated(seen: list[tuple[int, int]], tasks: list[Task] = TASKS) -> list[int]:
    """The versions an evaluation takes when the orchestrator looks at (version, step)s."""
    taken: list[int] = []

    class Recorded(Evaluation):
        async def patiently(self, version: int) -> None:
            taken.append(version)

    evaluation = Recorded(
        tasks, None, every=5, final_step=12, concurrency=1,
        log_file=None, watchdog=None, watch_seconds=1.0,
    )  # fmt: skip

    async def look() -> None:
        for version, step in seen:
            await evaluation.when_due(version, step)

    asyncio.run(look())
    return taken


def test_one_evaluation_in_every_window_even_when_its_multiple_is_passed_over() -> None:
    # Every version seen: the multiples, and the final step once.
    assert evaluated([(v, v) for v in range(13)]) == [0, 5, 10, 12]
    # Looked at twice, evaluated once.
    assert evaluated([(0, 0), (0, 0), (5, 5), (5, 5)]) == [0, 5]
    # A fast trainer went from 4 to 6 between two looks: 6 stands for 5; 7 and 9 do not
    # start another; 11 does not either (10 was seen).
    assert evaluated([(0, 0), (4, 4), (6, 6), (7, 7), (9, 9), (10, 10), (11, 11)]) == [0, 6, 10]
    # A resumed run's orchestrator first sees version 7: it waits for the next window.
    assert evaluated([(7, 7), (8, 8), (11, 11), (12, 12)]) == [11, 12]
    # Without held-out tasks nothing is evaluated.
    assert evaluated([(0, 0), (5, 5), (12, 12)], tasks=[]) == []
