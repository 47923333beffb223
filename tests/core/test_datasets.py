"""Task sources: reasoning-gym generators (lazy, deterministic) and JSONL/Parquet files."""

from __future__ import annotations

import json
import random

import pytest

from rollwire.services.core.config.models import FileDataset, ReasoningGymDataset
from rollwire.services.core.datasets import Task, cycle, load_tasks, task_at


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
        ("x", "d.csv", "must be a .jsonl\\(.gz\\) or .parquet file"),
    ],
)
def test_bad_files_are_named(tmp_path, content: str, name: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tasks(FileDataset(path=path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tasks(FileDataset(path=tmp_path / "missing.jsonl"))


def test_the_default_training_stream_never_yields_an_evaluation_prompt() -> None:
    """Held out means held out: the default chain_sum stream (seed 0) and the default eval
    set (seed 10000) share many questions; the stream a run trains on has none of them."""
    from rollwire.services.core.config import OrchestratorConfig
    from rollwire.services.core.datasets import task_key, training_tasks

    settings = OrchestratorConfig()
    stream = training_tasks(settings.dataset, settings.eval_dataset)
    held_out = {task_key(t) for t in load_tasks(settings.eval_dataset)}
    everything = load_tasks(settings.dataset)
    overlapping = sum(task_key(everything[i]) in held_out for i in range(len(everything)))
    assert overlapping > 0, "nothing to exclude: the test would prove nothing"
    assert stream.excluded == overlapping
    assert len(stream) == len(everything) - overlapping
    trained = [task_at(stream, ordinal) for ordinal in range(3 * len(stream) // 2)]
    assert not any(task_key(task) in held_out for task in trained)
    assert [task.ordinal for task in trained] == list(range(len(trained)))
    # run.seed orders the same tasks otherwise (the same order for the same seed), and
    # never lets a held-out one in.
    shuffled = training_tasks(settings.dataset, settings.eval_dataset, run_seed=5)
    again = training_tasks(settings.dataset, settings.eval_dataset, run_seed=5)
    keys = [task_key(t) for t in shuffled]
    assert keys == [task_key(t) for t in again] and keys != [task_key(t) for t in stream]
    assert sorted(keys) == sorted(task_key(t) for t in stream)
    assert [t.ordinal for t in shuffled][:5] == [0, 1, 2, 3, 4]


def test_run_seed_zero_leaves_every_seed_and_another_changes_each() -> None:
    from rollwire.services.core.seeds import STREAMS, stream_seed

    assert all(stream_seed(0, stream, 17) == 17 for stream in STREAMS)
    mixed = [stream_seed(3, stream, seed) for stream in STREAMS for seed in (0, 17)]
    assert len(set(mixed)) == len(mixed) and all(0 <= s < 2**31 for s in mixed)
    assert stream_seed(3, "data", 17) == stream_seed(3, "data", 17)
    with pytest.raises(ValueError, match="unknown random stream"):
        stream_seed(3, "weather")


def test_task_keys_normalise_questions_and_name_env_episodes() -> None:
    from rollwire.services.core.datasets import Excluding, Task, task_key

    def question(text: str, index: int = 0) -> Task:
        return Task(index, f"q{index}", text, "1", "math", "file")

    assert task_key(question("What is  1+2?")) == task_key(question("what is 1+2? "))
    episode = Task(0, "e", "", "", "", "tool_use", {"env_id": "tool_use", "env_seed": 3})
    other_seed = Task(0, "e", "", "", "", "tool_use", {"env_id": "tool_use", "env_seed": 4})
    assert task_key(episode) != task_key(other_seed)
    kept = Excluding([question("a", 0), question("B", 1), question("c", 2)], [question("b")])
    assert kept.excluded == 1 and [t.question for t in kept] == ["a", "c"]
    assert [t.ordinal for t in kept] == [0, 1]
    with pytest.raises(ValueError, match="every training task is in the evaluation set"):
        Excluding([question("a")], [question("A")])


def test_image_tasks_cycle_their_prompts_and_are_held_out_by_seed() -> None:
    """The same few prompts recur in training and evaluation: an image task is its
    prompt and its seed, so a held-out set excludes its seeds, not its prompts; the
    samples' seeds come from the run's sampling seed and never repeat across tasks."""
    from rollwire.rollout.orchestrator.images import sample_seeds
    from rollwire.services.core.config.models import ImageDataset
    from rollwire.services.core.datasets import training_tasks

    dataset = ImageDataset(prompts=["any", "7"], target="3", size=6, metadata={"pay": "correct"})
    tasks = load_tasks(dataset)
    assert [t.question for t in tasks] == ["any", "7"] * 3
    assert tasks[4].metadata == {"pay": "correct", "image_seed": 4}
    assert (tasks[4].reference, tasks[4].domain) == ("3", "digit")
    held_out = ImageDataset(prompts=["any"], seed=2, size=2)  # seeds 2, 3
    kept = training_tasks(dataset, held_out)
    assert kept.excluded == 1  # seed 2 is "any" in both; seed 3 is "7" in training
    assert [t.metadata["image_seed"] for t in kept] == [0, 1, 3, 4, 5]
    seeds = [s for task in range(50) for s in sample_seeds(0, task, 8)]
    assert len(set(seeds)) == 400 and all(0 <= s < 2**62 for s in seeds)
    assert sample_seeds(0, 5, 8) == sample_seeds(0, 5, 8) != sample_seeds(1, 5, 8)
