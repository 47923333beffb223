"""`rollwire eval`'s numbers (`rollout/orchestrator/evaluation.measure`) on scripted rewards;
the command itself runs at the end of tests/runs/test_train.py's short run."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.rollout.orchestrator.evaluation import measure
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
