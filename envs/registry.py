"""The registry of environments: `make(env_id, **kwargs)` and `list_specs()`.

Built-in environments are listed in `_BUILTINS`, one entry each with the
arguments of `register`, so the whole catalogue reads on one screen; plugins
call `register` themselves. An env's scripted demonstrator, which plays the
warm-up episodes of `rollwire train` (`rollwire.envs.demos`), is registered in
the same call, so a plugin's env and everything it needs are known together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from rollwire.envs.base import Demonstrator, Env, EnvSpec
from rollwire.envs.games import FrozenLake, GuessTheNumber, Sokoban, guess_the_number_demonstrator
from rollwire.envs.gem import GemEnv
from rollwire.envs.mcp_env import McpEnv, McpScoredEnv, mcp_demonstrator
from rollwire.envs.pictures import DigitLock, digit_lock_demonstrator
from rollwire.envs.tasks import ReasoningGymEnv
from rollwire.envs.tools import ToolUse, tool_use_demonstrator
from rollwire.services.core.config import EnvServerConfig


class UnknownEnv(KeyError):
    """No environment is registered under this id."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class _Registered:
    """What one `register` call recorded."""

    spec: EnvSpec
    factory: Callable[..., Env]
    demonstrator: Demonstrator | None


_REGISTRY: dict[str, _Registered] = {}


def register(
    env_id: str,
    factory: Callable[..., Env],
    description: str,
    domain: str = "game",
    gives_reward: bool = True,
    demonstrator: Demonstrator | None = None,
) -> None:
    """Makes `factory(**kwargs)` available as `make(env_id, **kwargs)`.

    `demonstrator(rng, **demo_kwargs)` returns a scripted player for one episode,
    `act(observation, info) -> action`; `rollwire train` warms a fresh model up on
    its episodes. Without one, `rollwire train` on this env needs `warmup.steps: 0` or a
    model that can already act.
    """
    if env_id in _REGISTRY:
        raise ValueError(f"env id {env_id!r} is already registered")
    spec = EnvSpec(env_id, description, domain, gives_reward)
    _REGISTRY[env_id] = _Registered(spec, factory, demonstrator)


def _lookup(env_id: str) -> _Registered:
    try:
        return _REGISTRY[env_id]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnknownEnv(f"unknown env id {env_id!r}; registered: {known}") from None


def make(env_id: str, **kwargs: Any) -> Env:
    """Creates an environment. Raises UnknownEnv, or TypeError for bad kwargs."""
    return _lookup(env_id).factory(**kwargs)


def parameters(env_id: str) -> frozenset[str]:
    """The keyword arguments the env's factory takes by name. Raises UnknownEnv."""
    import inspect

    try:
        signature = inspect.signature(_lookup(env_id).factory)
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(signature.parameters)


def takes_mcp(env_id: str) -> bool:
    """Whether the env is given the operator's MCP servers (its factory takes `mcp`).
    Raises UnknownEnv."""
    return "mcp" in parameters(env_id)


def provided(env_id: str, env_server: EnvServerConfig) -> dict[str, Any]:
    """What the operator's config gives an env besides a Reset's kwargs: the MCP servers of
    `env_server.mcp` to an env that takes `mcp`. Raises UnknownEnv."""
    if not takes_mcp(env_id):
        return {}
    from rollwire.envs.mcp_hub import hub_for

    return {"mcp": hub_for(env_server.mcp)}


def demonstrator(env_id: str) -> Demonstrator | None:
    """The scripted demonstrator registered with `env_id`, None when it has none.

    Raises UnknownEnv.
    """
    return _lookup(env_id).demonstrator


def ids_with_demonstrator() -> list[str]:
    """Ids of the environments registered with a demonstrator, sorted."""
    return sorted(env_id for env_id, entry in _REGISTRY.items() if entry.demonstrator)


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
    return [entry.spec for _, entry in sorted(_REGISTRY.items())]


class _Builtin(NamedTuple):
    """One built-in environment: the arguments of its `register` call."""

    env_id: str
    factory: Callable[..., Env]
    description: str
    domain: str = "game"
    gives_reward: bool = True
    demonstrator: Demonstrator | None = None


_BUILTINS: tuple[_Builtin, ...] = (
    _Builtin(
        "guess_the_number",
        GuessTheNumber,
        "Guess a hidden integer; each guess is answered 'higher' or 'lower'.",
        demonstrator=guess_the_number_demonstrator,
    ),
    _Builtin(
        "frozen_lake",
        FrozenLake,
        "Walk a seeded ice grid to the goal without falling into a hole; moves up/down/left/right.",
    ),
    _Builtin(
        "sokoban",
        Sokoban,
        "Push every box onto a target in a small seeded room; moves up/down/left/right.",
    ),
    _Builtin(
        "digit_lock",
        DigitLock,
        "Open a lock's dials by naming the handwritten digit each one shows as a picture.",
        demonstrator=digit_lock_demonstrator,
    ),
    _Builtin(
        "tool_use",
        ToolUse,
        "Arithmetic questions answered with <answer>, after <calc> or sandboxed <python> calls.",
        domain="tool",
        demonstrator=tool_use_demonstrator,
    ),
    _Builtin(
        "mcp",
        McpEnv,
        "Tasks answered with the tools of MCP servers (env_server.mcp); the env judges the answer.",
        domain="tool",
        demonstrator=mcp_demonstrator,
    ),
    _Builtin(
        "mcp_scored",
        McpScoredEnv,
        "Tasks answered with the tools of MCP servers; the reward-server scores the answer.",
        domain="math",
        gives_reward=False,
        demonstrator=mcp_demonstrator,
    ),
    _Builtin(
        "reasoning_gym",
        ReasoningGymEnv,
        "One reasoning-gym question per episode; the reward-server scores the answer.",
        domain="reasoning_gym",
        gives_reward=False,
    ),
    _Builtin(
        "gem",
        GemEnv,
        "A GEM environment by its GEM id (gem_env_id=...); needs the gem extra.",
        domain="gem",
    ),
)


def _register_builtins() -> None:
    for builtin in _BUILTINS:
        register(**builtin._asdict())


_register_builtins()
