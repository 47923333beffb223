"""Task environments: one question, one answer, scored elsewhere.

`ReasoningGymEnv` serves a reasoning-gym dataset as single-turn episodes. It
gives no reward itself (its spec says `gives_reward=False`): the final step's
info carries the reference and the task's metadata, which the orchestrator
passes to the reward-server's `reasoning_gym` scorer
(`rollwire.reward.scorers.reasoning_gym_score`) with the action as the
response, so the answer belongs in `<answer>...</answer>`.
"""

from __future__ import annotations

import json
import random
from typing import Any

from rollwire.envs.base import Env, InvalidAction, StepResult
from rollwire.envs.games import int_kwarg
from rollwire.services.core.config.models import ReasoningGymDataset
from rollwire.services.core.datasets import ReasoningGymTasks, Task


class MissingDependency(ImportError, ValueError):
    """An env needs a package that is not installed.

    Also a ValueError, so the env-server answers INVALID_ARGUMENT with the
    message (as for any env it cannot create) instead of an internal error.
    """


def json_safe(value: Any) -> Any:
    """`value` as plain JSON types (tuples become lists, anything else odd its str()).

    What the env-server's Struct would make of it anyway; doing it here means
    an in-process caller sees exactly what a remote one does.
    """
    return json.loads(json.dumps(value, default=str))


class ReasoningGymEnv(Env):
    """One reasoning-gym question per episode.

    kwargs: `dataset` (a reasoning-gym dataset name, default "chain_sum"),
    `size` (items in the dataset), `dataset_seed` (the generator's seed),
    `config` (the dataset's own settings; None for reasoning-gym's defaults)
    and `template` (the observation, with "{question}" where the question goes).

    `reset(seed)` picks item `seed % size` (a random one for seed None); the
    observation is the question. `step(answer)` accepts any text, ends the
    episode with reward 0.0 and info {"reference", "metadata", "task_id"}.
    """

    def __init__(
        self,
        dataset: str = "chain_sum",
        size: int = 10_000,
        dataset_seed: int = 0,
        config: dict[str, Any] | None = None,
        template: str = "{question}",
    ) -> None:
        if not isinstance(dataset, str):
            raise TypeError(f"dataset must be a reasoning-gym dataset name, got {dataset!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict of dataset settings, got {config!r}")
        if not isinstance(template, str) or "{question}" not in template:
            raise ValueError(f"template must be text containing {{question}}, got {template!r}")
        settings = ReasoningGymDataset(
            name=dataset,
            size=int_kwarg("size", size, minimum=1),
            seed=int_kwarg("dataset_seed", dataset_seed),
            kwargs=config or {},
        )
        try:
            self._tasks = ReasoningGymTasks(settings)  # ValueError for a bad name or config
        except ImportError as error:
            raise MissingDependency(
                f"the 'reasoning_gym' env needs reasoning-gym ({error}); "
                "install it with the reward extra: pip install 'rollwire[reward]'"
            ) from error
        self.template = template
        self._task: Task | None = None
        self._done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        index = random.randrange(len(self._tasks)) if seed is None else seed % len(self._tasks)
        self._task = self._tasks[index]
        self._done = False
        info = {"task_id": self._task.task_id, "index": index, "dataset": self._task.source}
        return self.template.replace("{question}", self._task.question), info

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise InvalidAction("call reset before step")
        if self._done:
            raise InvalidAction("the episode has ended; call reset to start another")
        self._done = True
        info = {
            "reference": self._task.reference,
            "metadata": json_safe(self._task.metadata),
            "task_id": self._task.task_id,
        }
        return "", 0.0, True, False, info
