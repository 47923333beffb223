"""The environment API: the GEM / Gymnasium shape, with text observations and actions.

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action)

An env that cannot accept an action raises `InvalidAction` with a message the
policy's author can act on; the env-server turns it into INVALID_ARGUMENT.

An env may come with a scripted demonstrator, registered with it, whose
episodes teach a fresh model to act before RL (`rollwire.envs.demos`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

StepResult = tuple[str, float, bool, bool, dict[str, Any]]
"""(observation, reward, terminated, truncated, info)."""
Act = Callable[[str, dict[str, Any]], str]
"""One demonstrated episode's player: `act(observation, info) -> action`."""
Demonstrator = Callable[..., Act]
"""`demonstrator(rng, **demo_kwargs) -> act`: a scripted player for a fresh episode, drawing
its choices from `rng` (a `random.Random`) so that the same rng plays the same way."""


class InvalidAction(ValueError):
    """The environment rejects this action (wrong format, illegal move, too long)."""


class Env(abc.ABC):
    """A text environment. Subclasses implement `reset` and `step`; `close` is optional."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Starts an episode; the same seed gives the same episode."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Applies `action`; returns (observation, reward, terminated, truncated, info)."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Releases resources held by the environment."""


@dataclass(frozen=True)
class EnvSpec:
    """What the registry knows about an environment."""

    env_id: str
    description: str
    domain: str
    gives_reward: bool
