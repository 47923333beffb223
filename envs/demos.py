"""Scripted demonstrators: episodes played by a simple script, as warm-up examples.

A fresh model cannot act in an environment at all, so RL on it has no signal.
Before an agentic run, the warm-up teaches it from episodes that a script
plays in the environment itself, rendered into tokens exactly as the agent
loop renders them (`rollwire.rollout.orchestrator.agent`), with the loss on the script's
actions only. The scripts are deliberately imperfect — like demonstrations of
uneven quality — so that RL has something to improve.

Each demonstrator is a factory `(rng, **demo_kwargs) -> act(observation, info) -> action`
(`rollwire.envs.base.Demonstrator`), registered with its env in the same
`rollwire.envs.registry.register` call, built-in or plugin alike. The built-in
ones sit next to the env they play (`guess_the_number_demonstrator` in
`games`, `tool_use_demonstrator` in `tools`): the registry imports them, and
this module plays through the registry, so neither may import the other.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rollwire.envs import registry
from rollwire.envs.base import Act, Demonstrator, offered_tools


def find_demonstrator(env_id: str) -> Demonstrator:
    """The demonstrator registered with `env_id`; ValueError saying what to do when there is none."""
    try:
        factory = registry.demonstrator(env_id)
    except registry.UnknownEnv:
        known = ", ".join(spec.env_id for spec in registry.list_specs()) or "none"
        raise ValueError(
            f"no scripted demonstrator for env {env_id!r}: no env is registered under that id "
            f"(registered: {known}); an env from a plugin needs its module in env_server.plugins"
        ) from None
    if factory is None:
        known = ", ".join(registry.ids_with_demonstrator()) or "none"
        raise ValueError(
            f"no scripted demonstrator for env {env_id!r} (envs with one: {known}); "
            "register one with the env (rollwire.envs.registry.register(..., demonstrator=...)), "
            "set warmup.steps: 0, or start from a model that can already act"
        )
    return factory


def demonstrator(env_id: str, rng: random.Random, **kwargs: Any) -> Act:
    """A scripted player of one `env_id` episode; ValueError when the env has no demonstrator."""
    return find_demonstrator(env_id)(rng, **kwargs)


def demo_batches(
    env_id: str,
    env_kwargs: dict[str, Any],
    seeds: range,
    tokenizer: Any,
    make_turns: Callable[[], Any],
    demo_kwargs: dict[str, Any],
    max_turns: int,
    max_tokens: int,
    provided: dict[str, Any] | None = None,
) -> Callable[[random.Random, int], list[tuple]]:
    """A batch function for `rollwire.trainer.pipelines.warmup.warm_up_on`: scripted episodes
    as (token ids, taught mask), and the images they show (with their offsets) when they
    show any. `make_turns()` renders a fresh episode's turns as the agent loop does.

    `provided`: what the operator gives the env besides `env_kwargs`
    (`rollwire.envs.registry.provided`: an `mcp` env's MCP servers).

    Raises ValueError at once, not at the first batch, when `env_id` has no demonstrator.
    """
    play = find_demonstrator(env_id)
    eos = int(tokenizer.eos_token_id)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def episode(rng: random.Random) -> tuple:
        env = registry.make(env_id, **env_kwargs, **(provided or {}))
        act = play(rng, **demo_kwargs)
        observation, info = env.reset(rng.choice(seeds))
        turns = make_turns()
        ids, images = turns.first(observation, offered_tools(info))
        taught = [0] * len(ids)
        try:
            for _ in range(max_turns):
                action = act(observation, info)
                action_ids = [*encode(action), eos]
                if len(ids) + len(action_ids) > max_tokens:
                    break
                ids += action_ids
                taught += [1] * len(action_ids)
                observation, _, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    break
                role = str(info.get("observation_role", "user"))
                following, shown = turns.then(action, True, observation, role)
                if len(ids) + len(following) > max_tokens:
                    break
                images += [image.with_offset(len(ids) + image.offset) for image in shown]
                ids += following
                taught += [0] * len(following)
        finally:
            env.close()
        return (ids, taught, images) if images else (ids, taught)

    def batch(rng: random.Random, size: int) -> list[tuple]:
        return [episode(rng) for _ in range(size)]

    return batch
