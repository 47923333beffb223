"""The registry of environments: `make(env_id, **kwargs)` and `list_specs()`.

Built-in environments are registered in `_BUILTINS`, one line each, so the
whole catalogue reads on one screen; plugins call `register`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollwire.envs.base import Env, EnvSpec


class UnknownEnv(KeyError):
    """No environment is registered under this id."""

    def __str__(self) -> str:
        return str(self.args[0])


_REGISTRY: dict[str, tuple[EnvSpec, Callable[..., Env]]] = {}


def register(
    env_id: str,
    factory: Callable[..., Env],
    description: str,
    domain: str = "game",
    gives_reward: bool = True,
) -> None:
    """Makes `factory(**kwargs)` available as `make(env_id, **kwargs)`."""
    if env_id in _REGISTRY:
        raise ValueError(f"env id {env_id!r} is already registered")
    _REGISTRY[env_id] = (EnvSpec(env_id, description, domain, gives_reward), factory)


def make(env_id: str, **kwargs: Any) -> Env:
    """Creates an environment. Raises UnknownEnv, or TypeError for bad kwargs."""
    try:
        _, factory = _REGISTRY[env_id]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnknownEnv(f"unknown env id {env_id!r}; registered: {known}") from None
    return factory(**kwargs)


def load_plugins(modules: list[str]) -> None:
    """Imports each module so that it can `register` its environments (once per process)."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ValueError(f"env plugin module {name!r} cannot be imported: {error}") from None


def list_specs() -> list[EnvSpec]:
    """Every registered environment, sorted by id."""
    return [spec for _, (spec, _) in sorted(_REGISTRY.items())]


def _register_builtins() -> None:
    from rollwire.envs.games import FrozenLake, GuessTheNumber, Sokoban
    from rollwire.envs.gem import GemEnv
    from rollwire.envs.tasks import ReasoningGymEnv
    from rollwire.envs.tools import ToolUse

    register(
        "guess_the_number",
        GuessTheNumber,
        "Guess a hidden integer; each guess is answered 'higher' or 'lower'.",
    )
    register(
        "frozen_lake",
        FrozenLake,
        "Walk a seeded ice grid to the goal without falling into a hole; moves up/down/left/right.",
    )
    register(
        "sokoban",
        Sokoban,
        "Push every box onto a target in a small seeded room; moves up/down/left/right.",
    )
    register(
        "tool_use",
        ToolUse,
        "Arithmetic questions answered with <answer>, after <calc> or sandboxed <python> calls.",
        domain="tool",
    )
    register(
        "reasoning_gym",
        ReasoningGymEnv,
        "One reasoning-gym question per episode; the reward-server scores the answer.",
        domain="reasoning_gym",
        gives_reward=False,
    )
    register(
        "gem",
        GemEnv,
        "A GEM environment by its GEM id (gem_env_id=...); needs the gem extra.",
        domain="gem",
    )


_register_builtins()
