"""Task sources: reasoning-gym generators (lazy, deterministic) and JSONL/Parquet files."""

from __future__ import annotations

import json
import random

import pytest

from rollwire.services.core.config.models import FileDataset, ReasoningGymDataset
from rollwire.services.core.datasets import Task, cycle, load_tasks


def test_reasoning_gym_tasks_are_lazy_and_deterministic() -> None:
    config = ReasoningGymDataset(size=1000, seed=5)
    first, again = load_tasks(config), load_tasks(config)
    assert len(first) == 1000
    assert first[999] == again[999] and first[3] != first[4]
    task = first[3]
    assert task.ordinal == 3 and task.domain == "reasoning_gym" and task.source == "chain_sum"
    assert task.prompt("{expression} =") == task.metadata["expression"] + " ="
    assert len(random.Random(0).sample(first, 5)) == 5  # usable as a sequence by the warm-up
    with pytest.raises(ValueError, match="names 'nope'"):
        task.prompt("{nope}")
    with pytest.raises(ValueError, match="reasoning-gym dataset 'no_such_task'"):
        load_tasks(ReasoningGymDataset(name="no_such_task"))


def test_cycle_keeps_ordinals_increasing() -> None:
    tasks = [Task(i, f"t{i}", "q", "a", "math", "file") for i in range(3)]
    stream = cycle(tasks)
    drawn = [next(stream) for _ in range(7)]
    assert [t.ordinal for t in drawn] == list(range(7))
    assert len({t.task_id for t in drawn}) == 7  # a group id never repeats across epochs


def test_jsonl_and_parquet_files(tmp_path) -> None:
    rows = [
        {"prompt": "1+1?", "answer": 2, "level": "easy"},
        {"prompt": "2+2?", "answer": "4", "level": "easy"},
    ]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = load_tasks(FileDataset(path=jsonl))
    assert [(t.question, t.reference, t.domain, t.metadata) for t in tasks] == [
        ("1+1?", "2", "math", {"level": "easy"}),
        ("2+2?", "4", "math", {"level": "easy"}),
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "3+3?", "a": "6"}]), parquet)
    (task,) = load_tasks(
        FileDataset(path=parquet, prompt_field="q", answer_field="a", domain="exact_match")
    )
    assert (task.question, task.reference, task.domain) == ("3+3?", "6", "exact_match")


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ('{"prompt": "x"}\n', "a.jsonl", "needs fields 'prompt' and 'answer'"),
        ("not json\n", "b.jsonl", r"b.jsonl:1: not JSON"),
        ("", "c.jsonl", "holds no tasks"),
        ("x", "d.csv", "must end in .jsonl or .parquet"),
    ],
)
def test_bad_files_are_named(tmp_path, content: str, name: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tasks(FileDataset(path=path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tasks(FileDataset(path=tmp_path / "missing.jsonl"))
