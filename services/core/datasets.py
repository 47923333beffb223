"""Task sources for the orchestrator: reasoning-gym generators, JSONL/Parquet files,
environment seeds and image prompts.

Every task carries a monotonic `ordinal` (its position in the run's stream of
prompts), which later accounting (exactly-once training) keys on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollwire.services.core.config.models import (
    DatasetConfig,
    DigitsDataset,
    EnvDataset,
    FileDataset,
    ImageDataset,
    MixtureDataset,
    ReasoningGymDataset,
)
from rollwire.services.core.images import ImageRef, images_of


@dataclass(frozen=True)
class Task:
    ordinal: int
    task_id: str
    question: str
    reference: str
    domain: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[ImageRef, ...] = ()
    """What the prompt shows (a vision-language model): placed before its text."""

    def prompt(self, template: str) -> str:
        """The prompt text: `template` formatted with the question and metadata fields."""
        try:
            return template.format(
                question=self.question,
                **{k: v for k, v in self.metadata.items() if k != "question"},
            )
        except KeyError as error:
            raise ValueError(
                f"prompt_template names {error} which task {self.task_id} does not have"
            ) from None


def _with_answer_format(metadata: dict[str, Any], answer_format: str) -> dict[str, Any]:
    """The scorer reads `answer_format` from the item's metadata; the default needs none."""
    return metadata if answer_format == "tag" else {**metadata, "answer_format": answer_format}


class ReasoningGymTasks(Sequence[Task]):
    """A reasoning-gym dataset as tasks, generated on access (items are deterministic by index)."""

    def __init__(self, config: ReasoningGymDataset) -> None:
        import reasoning_gym

        try:
            self._dataset = reasoning_gym.create_dataset(
                config.name, size=config.size, seed=config.seed, **config.kwargs
            )
            self._dataset[0]
        except Exception as error:  # reasoning-gym raises assorted types for bad names and kwargs
            raise ValueError(
                f"reasoning-gym dataset {config.name!r} with {config.kwargs}: {error}"
            ) from None
        self._config = config

    def __len__(self) -> int:
        return self._config.size

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        entry = self._dataset[index]
        name, seed = self._config.name, self._config.seed
        return Task(
            index,
            f"{name}/{seed}/{index}",
            entry["question"],
            str(entry["answer"]),
            self._config.domain,
            name,
            _with_answer_format(entry["metadata"], self._config.answer_format),
        )


class SeededTasks(Sequence[Task]):
    """A dataset whose task i comes from seed `config.seed + i`, `config.size` of them
    (`task` makes one)."""

    def __init__(self, config: EnvDataset | ImageDataset) -> None:
        self._config = config

    def __len__(self) -> int:
        return self._config.size

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.task(index, self._config.seed + index)

    def task(self, index: int, seed: int) -> Task:
        raise NotImplementedError


class EnvTasks(SeededTasks):
    """Seeds of an environment as tasks: task i is an episode from seed `seed + i`.

    The env id and kwargs travel in the task's metadata (`env_id`, `env_kwargs`,
    `env_seed`); question and reference stay empty, the env supplies both.
    """

    def task(self, index: int, seed: int) -> Task:
        config = self._config
        return Task(
            index,
            f"{config.env_id}/{seed}",
            "",
            "",
            "",
            config.env_id,
            {"env_id": config.env_id, "env_kwargs": dict(config.env_kwargs), "env_seed": seed},
        )


class ImageTasks(SeededTasks):
    """Image prompts as tasks: task i asks for images of `prompts[i % len(prompts)]`
    from seed `seed + i` (its samples' own seeds are made from it), scored in the
    dataset's domain against `target`. The seed travels in the metadata (`image_seed`)."""

    def task(self, index: int, seed: int) -> Task:
        config = self._config
        return Task(
            index,
            f"images/{seed}",
            config.prompts[index % len(config.prompts)],
            config.target,
            config.domain,
            "images",
            {**config.metadata, "image_seed": seed},
        )


DIGITS_TRAIN = 1500
"""Images 0-1499 of scikit-learn's digits train; the other 297 are held out."""


@dataclass(frozen=True)
class Digits:
    """scikit-learn's 8x8 handwritten digits (shipped with it: nothing is downloaded)."""

    pixels: Any
    """[1797, 8, 8], values 0-16."""
    labels: Any

    @classmethod
    @functools.cache
    def load(cls) -> Digits:
        """The set, read once per process (an env-server makes an episode from it per Reset)."""
        from sklearn.datasets import load_digits

        digits = load_digits()
        return cls(digits.images, digits.target)

    def split(self, name: str) -> list[int]:
        """The indices of a split: `train` (0-1499) or `held_out` (the other 297)."""
        if name not in ("train", "held_out"):
            raise ValueError(f"a digits split is train or held_out, not {name!r}")
        return list(range(DIGITS_TRAIN) if name == "train" else range(DIGITS_TRAIN, len(self)))

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, index: int) -> int:
        return int(self.labels[index])

    def picture(self, index: int) -> ImageRef:
        """Digit `index` as an 8x8 greyscale PNG, by value (the processor scales it up)."""
        import numpy as np
        from PIL import Image

        from rollwire.services.core.images import encode_png

        grey = (self.pixels[index] * (255 / 16)).round().astype(np.uint8)
        return encode_png(Image.fromarray(grey))


class DigitsTasks(Sequence[Task]):
    """scikit-learn's 8x8 digits as image questions (`DigitsDataset`): the split's images
    in an order the seed fixes, each a PNG by value; the reference is its digit."""

    def __init__(self, config: DigitsDataset) -> None:
        self._digits, self._config = Digits.load(), config
        self._indices = self._digits.split(config.split)
        if config.seed:
            random.Random(config.seed).shuffle(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        config, digit = self._config, self._indices[index]
        return Task(
            index,
            f"digits/{digit}",
            config.question,
            str(self._digits.label(digit)),
            config.domain,
            "digits",
            _with_answer_format({"digit_index": digit}, config.answer_format),
            (self._digits.picture(digit),),
        )


class MixtureTasks(Sequence[Task]):
    """Datasets interleaved by weight: each round of sum(weights) positions holds `weight`
    tasks of each part, spread evenly (smooth weighted round robin), so the shares hold
    over any stretch of the run, not only on average. As many whole rounds as the part
    that runs out first allows."""

    def __init__(self, parts: list[tuple[Sequence[Task], int]]) -> None:
        self._parts = parts
        self._round: list[tuple[int, int]] = []  # (part, occurrence in the round)
        credit = [0] * len(parts)
        total = sum(weight for _, weight in parts)
        seen = [0] * len(parts)
        for _ in range(total):
            for k, (_, weight) in enumerate(parts):
                credit[k] += weight
            chosen = max(range(len(parts)), key=lambda k: credit[k])
            credit[chosen] -= total
            self._round.append((chosen, seen[chosen]))
            seen[chosen] += 1
        self._rounds = min(len(tasks) // weight for tasks, weight in parts)
        if self._rounds == 0:
            raise ValueError("a mixture part has fewer tasks than its weight")

    def __len__(self) -> int:
        return self._rounds * len(self._round)

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        round_, position = divmod(index, len(self._round))
        part, occurrence = self._round[position]
        tasks, weight = self._parts[part]
        task = tasks[round_ * weight + occurrence]
        return replace(task, ordinal=index, task_id=f"p{part}:{task.task_id}")


def load_tasks(
    config: ReasoningGymDataset | FileDataset | EnvDataset | ImageDataset | MixtureDataset,
) -> Sequence[Task]:
    """A dataset as a sequence of tasks (ordinals are positions in it)."""
    if isinstance(config, MixtureDataset):
        return MixtureTasks([(load_tasks(part.dataset), part.weight) for part in config.parts])
    if isinstance(config, ReasoningGymDataset):
        return ReasoningGymTasks(config)
    if isinstance(config, EnvDataset):
        return EnvTasks(config)
    if isinstance(config, ImageDataset):
        return ImageTasks(config)
    if isinstance(config, DigitsDataset):
        return DigitsTasks(config)
    rows = list(read_rows(config.path))
    tasks = []
    for index, row in enumerate(rows):
        if config.prompt_field not in row or config.answer_field not in row:
            raise ValueError(
                f"{config.path} row {index}: needs fields {config.prompt_field!r} and {config.answer_field!r}"
            )
        fields = (config.prompt_field, config.answer_field, config.images_field)
        metadata = {k: v for k, v in row.items() if k not in fields}
        images = ()
        if row.get(config.images_field) is not None:
            images = images_of(
                row[config.images_field], config.path.parent, f"{config.path} row {index}"
            )
        tasks.append(
            Task(
                index,
                f"{config.path.stem}/{index}",
                str(row[config.prompt_field]),
                str(row[config.answer_field]),
                config.domain,
                config.path.name,
                _with_answer_format(
                    json.loads(json.dumps(metadata, default=str)), config.answer_format
                ),
                images,
            )
        )
    if not tasks:
        raise ValueError(f"{config.path} holds no tasks")
    return tasks


def task_key(task: Task) -> tuple[str, ...]:
    """What makes two tasks the same prompt: the question with case and spacing
    normalised, for env tasks (no question) the env, its kwargs and the seed, for image
    tasks (the same few prompts over and over) the prompt and the seed."""
    if "image_seed" in task.metadata:
        return ("image", task.question, str(task.metadata["image_seed"]))
    if "digit_index" in task.metadata:
        return ("digit", str(task.metadata["digit_index"]))
    if task.images:  # one question about many images: the images tell them apart
        shown = tuple(image.uri or hashlib.sha256(image.data).hexdigest() for image in task.images)
        return ("question", " ".join(task.question.lower().split()), *shown)
    if task.question:
        return ("question", " ".join(task.question.lower().split()))
    meta = task.metadata
    kwargs = json.dumps(meta.get("env_kwargs", {}), sort_keys=True, default=str)
    return ("episode", str(meta.get("env_id", task.source)), kwargs, str(meta.get("env_seed")))


class Excluding(Sequence[Task]):
    """`tasks` without those whose `task_key` is in `held_out`: the training stream of a
    run never yields a prompt of its evaluation set; with `order_seed`, in that seed's
    order (a permutation), else in the dataset's. Ordinals are positions in what is
    left, so a restarted run numbers its prompts the same way. `excluded` counts the
    tasks left out."""

    def __init__(
        self, tasks: Sequence[Task], held_out: Sequence[Task], order_seed: int | None = None
    ) -> None:
        keys = {task_key(task) for task in held_out}
        self._tasks = tasks
        self._kept = [i for i in range(len(tasks)) if task_key(tasks[i]) not in keys]
        self.excluded = len(tasks) - len(self._kept)
        if not self._kept:
            raise ValueError("every training task is in the evaluation set")
        if order_seed is not None:
            random.Random(order_seed).shuffle(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return replace(self._tasks[self._kept[index]], ordinal=index)


def training_tasks(
    dataset: DatasetConfig, eval_dataset: DatasetConfig | None, run_seed: int = 0
) -> Excluding:
    """The tasks a run trains on: `dataset` without any prompt of `eval_dataset`, in the
    order `run.seed` gives (`rollwire.services.core.seeds`; 0: the dataset's own)."""
    from rollwire.services.core.seeds import stream_seed

    held_out = load_tasks(eval_dataset) if eval_dataset is not None else []
    order = None if run_seed == 0 else stream_seed(run_seed, "data")
    return Excluding(load_tasks(dataset), held_out, order)


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a dataset a user has: a `.jsonl` (or one-record-a-line `.json`)
    file, gzipped or not (`.jsonl.gz`), a `.parquet` file, or a folder a Hugging Face `datasets.Dataset` was saved into
    with `save_to_disk` (read with pyarrow; no hub, no `datasets` needed)."""
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if path.is_dir():
        yield from _saved_dataset_rows(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json") or path.name.endswith((".jsonl.gz", ".json.gz")):
        import gzip

        opened = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()  # noqa: SIM115 - closed by the with below
        with opened as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{number}: not JSON: {error}") from None
    else:
        raise ValueError(
            f"dataset {path} must be a .jsonl(.gz) or .parquet file, or a folder saved with "
            "datasets' save_to_disk"
        )


def _saved_dataset_rows(folder: Path) -> Iterator[dict[str, Any]]:
    """Rows of a `save_to_disk` folder: its state.json lists Arrow stream files."""
    import pyarrow as pa

    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"{folder} holds a DatasetDict; point at one of its splits: "
            + ", ".join(str(folder / split) for split in splits)
        )
    state_path = folder / "state.json"
    if not state_path.exists():
        raise ValueError(f"{folder} is not a folder saved with datasets' save_to_disk")
    for entry in json.loads(state_path.read_text()).get("_data_files", []):
        with pa.memory_map(str(folder / entry["filename"])) as source:
            yield from pa.ipc.open_stream(source).read_all().to_pylist()


def task_at(tasks: Sequence[Task], ordinal: int) -> Task:
    """The task a run's stream of prompts holds at `ordinal`: `tasks` again and again,
    each pass (epoch) with ordinals that keep increasing."""
    epoch, index = divmod(ordinal, len(tasks))
    task = tasks[index]
    return replace(
        task, ordinal=task.ordinal + epoch * len(tasks), task_id=f"{task.task_id}@{epoch}"
    )


def cycle(tasks: Sequence[Task], start: int = 0) -> Iterator[Task]:
    """Tasks in order from ordinal `start`, again and again (see `task_at`)."""
    ordinal = start
    while True:
        yield task_at(tasks, ordinal)
        ordinal += 1
