"""GEM environments (the `gem-llm` package) behind rollwire's env API.

    make("gem", gem_env_id="game:Sokoban-v0-easy")

GEM's API already has the Gymnasium shape (`reset(seed) -> (obs, info)`,
`step(action) -> (obs, reward, terminated, truncated, info)`), so the adapter
only makes the values plain: text observations, float rewards, bool flags and
JSON-safe info. GEM's own rules apply unchanged: its games read answers in
`\\boxed{...}` and answer a malformed action with a reward, not an error.

Install with the `gem` extra (`pip install rollwire[gem]`). gem-llm 0.1.0
pins reasoning-gym==0.1.23 (the `reward` extra allows it), nltk==3.9.1 and
msgspec==0.19.0; it needs no torch.

Two things GEM does process-wide, which this adapter contains or documents:

- importing `gem` calls `logging.basicConfig(level=INFO)`; the adapter puts
  the root logger's handlers and level back as they were;
- GEM seeds Python's global `random` and numpy's global generator in
  `reset(seed)` and draws from them, so a GEM episode is reproducible from its
  seed only while nothing else in the process draws from those generators
  between its reset and steps (rollwire's own envs use private generators).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from rollwire.envs.base import Env, InvalidAction, StepResult
from rollwire.envs.tasks import MissingDependency, json_safe


class GemUnavailable(MissingDependency):
    """gem-llm cannot be imported here (an ImportError, and a ValueError for the env-server)."""


def _import_gem() -> ModuleType:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
    except ImportError as error:
        raise GemUnavailable(
            f"the 'gem' env needs gem-llm, which cannot be imported here ({error}); "
            "install it with the gem extra: pip install 'rollwire[gem]' "
            "(gem-llm==0.1.0 pins reasoning-gym==0.1.23, nltk==3.9.1, msgspec==0.19.0)"
        ) from error
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
    return gem


class GemEnv(Env):
    """A GEM environment by its GEM id (e.g. "game:GuessTheNumber-v0-easy"), with GEM kwargs.

    Games ("game:") and reasoning-gym tasks ("rg:") run inline: they are fast,
    and GEM's global-generator seeding stays reproducible only while one
    thread runs them. Every other GEM family (code, math, qa, ...) may run
    subprocesses, graders or network calls, so it is `blocking` and the env
    host runs its calls in a thread pool.
    """

    blocking: bool = False

    def __init__(self, gem_env_id: str, **kwargs: Any) -> None:
        if not isinstance(gem_env_id, str) or not gem_env_id:
            raise TypeError(
                f"gem_env_id must be a GEM env id such as 'game:Sokoban-v0-easy', got {gem_env_id!r}"
            )
        gem = _import_gem()
        self.gem_env_id = gem_env_id
        self.blocking = not gem_env_id.startswith(("game:", "rg:"))
        self._env = gem.make(gem_env_id, **kwargs)  # ValueError for an unknown id
        self._started = False

    def _text(self, observation: Any, where: str) -> str:
        if not isinstance(observation, str):
            raise TypeError(
                f"GEM env {self.gem_env_id!r} returned a {type(observation).__name__} observation from {where}; "
                "only text environments are supported"
            )
        return observation

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        observation, info = self._env.reset(seed=seed)
        self._started = True
        return self._text(observation, "reset"), json_safe(dict(info or {}))

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise InvalidAction("call reset before step")
        observation, reward, terminated, truncated, info = self._env.step(action)
        return (
            self._text(observation, "step"),
            float(reward),
            bool(terminated),
            bool(truncated),
            json_safe(dict(info or {})),
        )

    def close(self) -> None:
        close = getattr(self._env, "close", None)
        if callable(close):
            close()
