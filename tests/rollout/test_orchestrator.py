"""The orchestrator stops a run that cannot succeed instead of retrying prompts forever: a
prompt template the data cannot fill, and groups that all fail."""

from __future__ import annotations

import json

import pytest

from rollwire.rollout.orchestrator.loop import GroupsKeepFailing, Orchestrator
from rollwire.services.core.config import RunConfig
from rollwire.services.core.datasets import Task, load_tasks
from rollwire.services.core.tiny import build_tokenizer

NOWHERE = {  # never called: channels and sockets connect only when used
    "rollout_servers": ["127.0.0.1:9"],
    "reward_servers": ["127.0.0.1:9"],
    "buffer_producer": "tcp://127.0.0.1:9",
}


def orchestrator(tmp_path, **settings) -> Orchestrator:
    config = RunConfig.model_validate(
        {"run": {"output_dir": str(tmp_path)}, "orchestrator": settings, "endpoints": NOWHERE}
    )
    return Orchestrator(config, build_tokenizer())


async def test_a_template_one_part_of_a_mixture_cannot_fill_is_refused_before_any_group(
    tmp_path,
) -> None:
    data = tmp_path / "sums.jsonl"
    data.write_text(json.dumps({"prompt": "1+2", "answer": "3"}) + "\n")
    mixture = {
        "type": "mixture",
        "parts": [
            {"dataset": {"type": "reasoning_gym"}},
            {"dataset": {"type": "file", "path": str(data)}},
        ],
    }
    runner = orchestrator(tmp_path, dataset=mixture)
    try:
        with pytest.raises(ValueError, match=r"orchestrator.dataset: .*'expression'.*sums"):
            runner.check_prompts(load_tasks(runner.settings.dataset), "orchestrator.dataset")
        runner.settings.prompt_template = "{question} ="  # both parts have a question
        runner.check_prompts(load_tasks(runner.settings.dataset), "orchestrator.dataset")
    finally:
        runner.producer.close()


class _Prompts:
    def __init__(self) -> None:
        self.again: list[Task] = []

    def run_again(self, task: Task) -> None:
        self.again.append(task)


async def test_groups_that_all_fail_stop_the_run_with_the_last_error(tmp_path) -> None:
    runner = orchestrator(tmp_path, request_attempts=2, max_failed_groups_in_a_row=3)
    dropped = []

    async def drop(ordinal, task_id, outcome) -> None:
        dropped.append((ordinal, outcome))

    runner.producer.drop = drop
    prompts = _Prompts()
    try:
        for ordinal in range(2):  # each fails twice: run again, then given up
            task = Task(ordinal, f"t{ordinal}", "q", "a", "math", "test")
            await runner._group_failed(task, ValueError("boom"), prompts)
            await runner._group_failed(task, ValueError("boom"), prompts)
        assert len(prompts.again) == 2 and dropped == [(0, "failed"), (1, "failed")]
        runner.failed_in_a_row = 0  # what a finished group does (reap)
        for ordinal in range(2, 4):
            task = Task(ordinal, f"t{ordinal}", "q", "a", "math", "test")
            await runner._group_failed(task, ValueError("boom"), prompts)
            await runner._group_failed(task, ValueError("boom"), prompts)
        last = Task(9, "t9", "q", "a", "math", "test")
        await runner._group_failed(last, ValueError("no scorer"), prompts)
        with pytest.raises(GroupsKeepFailing, match="3 groups in a row.*no scorer"):
            await runner._group_failed(last, ValueError("no scorer"), prompts)
    finally:
        runner.producer.close()


async def test_an_env_dataset_needs_no_prompt_template(tmp_path) -> None:
    runner = orchestrator(
        tmp_path, dataset={"type": "env", "env_id": "guess_the_number"}, eval_dataset=None
    )
    try:
        runner.check_prompts(load_tasks(runner.settings.dataset), "orchestrator.dataset")
    finally:
        runner.producer.close()
