"""The environment API: the GEM / Gymnasium shape, with text observations and actions.

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action)

An observation is a string, or an `Observation` when it shows pictures too (an env that
draws its state for a vision-language policy): its text and its images, which the
policy sees before the text.

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

from rollwire.services.core.images import ImageRef


@dataclass(frozen=True)
class Observation:
    """An observation that shows pictures: its text and its images, in order (each an
    encoded image by value, or a path the orchestrator can read)."""

    text: str
    images: tuple[ImageRef, ...] = ()


def parts(observation: str | Observation) -> tuple[str, tuple[ImageRef, ...]]:
    """An observation's text and images (none for a plain string)."""
    if isinstance(observation, Observation):
        return observation.text, observation.images
    return observation, ()


StepResult = tuple[str | Observation, float, bool, bool, dict[str, Any]]
"""(observation, reward, terminated, truncated, info)."""
Act = Callable[[str | Observation, dict[str, Any]], str]
"""One demonstrated episode's player: `act(observation, info) -> action`."""
Demonstrator = Callable[..., Act]
"""`demonstrator(rng, **demo_kwargs) -> act`: a scripted player for a fresh episode, drawing
its choices from `rng` (a `random.Random`) so that the same rng plays the same way."""


def offered_tools(info: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools an env offers the policy, from its first `info`: `info["tools"]`, JSON
    text of a list of function schemas (`{"type": "function", "function": {"name",
    "description", "parameters"}}`, as chat templates take them). Text, not a list:
    the wire's Struct keeps no key order, and a schema's argument order is part of how
    a tool reads. None when the env offers none, or `info["tools"]` is not that text."""
    import json

    tools = info.get("tools")
    if not isinstance(tools, str):
        return None
    try:
        tools = json.loads(tools)
    except json.JSONDecodeError:
        return None
    if not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools):
        return None
    return tools


class InvalidAction(ValueError):
    """The environment rejects this action (wrong format, illegal move, too long)."""


class EpisodeAborted(RuntimeError):
    """The episode cannot go on through no fault of the policy (a tool server it used
    exited or hung): the env-server answers ABORTED, and the orchestrator starts the
    episode again from its seed, on this env-server or another."""


class Env(abc.ABC):
    """An environment. Subclasses implement `reset` and `step`; `close` is optional."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str | Observation, dict[str, Any]]:
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
