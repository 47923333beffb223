"""Scripted demonstrators: episodes played by a simple script, as warm-up examples.

A fresh model cannot act in an environment at all, so RL on it has no signal.
Before an agentic run, the warm-up teaches it from episodes that a script
plays in the environment itself, rendered into tokens exactly as the agent
loop renders them (`rollwire.rollout.orchestrator.agent`), with the loss on the script's
actions only. The scripts are deliberately imperfect — like demonstrations of
uneven quality — so that RL has something to improve.

Each demonstrator is a factory `(rng, **demo_kwargs) -> act(observation, info) -> action`,
registered by env id.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

Act = Callable[[str, dict[str, Any]], str]
_QUESTION = re.compile(r"What is (.+?)\?")
_NUMBER = re.compile(r"-?\d+")


def tool_use(
    rng: random.Random, tool_rate: float = 0.25, off_by_one_rate: float = 0.6, **_: Any
) -> Act:
    """Either computes with the calculator and answers what it returned (`tool_rate` of
    episodes), or answers at once, off by one `off_by_one_rate` of the time."""
    use_tool = rng.random() < tool_rate
    state: dict[str, Any] = {"turn": 0}

    def act(observation: str, info: dict[str, Any]) -> str:
        state["turn"] += 1
        if state["turn"] == 1:
            state["reference"] = str(info.get("reference", ""))
            question = _QUESTION.search(observation)
            if use_tool and question:
                return f"<calc>{question.group(1).strip()}</calc>"
            answer = state["reference"]
            if rng.random() < off_by_one_rate and _NUMBER.fullmatch(answer):
                answer = str(int(answer) + 1)
            return f"<answer>{answer}</answer>"
        numbers = _NUMBER.findall(observation)
        return f"<answer>{numbers[-1] if numbers else state['reference']}</answer>"

    return act


def guess_the_number(rng: random.Random, bisect_rate: float = 0.3, **_: Any) -> Act:
    """Guesses inside the range the answers so far allow: the midpoint `bisect_rate` of the
    time, anywhere in it otherwise."""
    bounds: dict[str, int] = {}

    def act(observation: str, info: dict[str, Any]) -> str:
        if not bounds:
            bounds.update(low=int(info.get("low", 1)), high=int(info.get("high", 100)))
        elif "last" in bounds:
            if "higher" in observation:
                bounds["low"] = bounds["last"] + 1
            elif "lower" in observation:
                bounds["high"] = bounds["last"] - 1
        low, high = bounds["low"], max(bounds["low"], bounds["high"])
        guess = (low + high) // 2 if rng.random() < bisect_rate else rng.randint(low, high)
        bounds["last"] = guess
        return str(guess)

    return act


DEMONSTRATORS: dict[str, Callable[..., Act]] = {
    "tool_use": tool_use,
    "guess_the_number": guess_the_number,
}


def demonstrator(env_id: str, rng: random.Random, **kwargs: Any) -> Act:
    """The demonstrator of `env_id`; ValueError naming those that exist when there is none."""
    try:
        factory = DEMONSTRATORS[env_id]
    except KeyError:
        known = ", ".join(sorted(DEMONSTRATORS))
        raise ValueError(
            f"no scripted demonstrator for env {env_id!r} (there are: {known}); "
            "set warmup.steps: 0 or start from a model that can already act"
        ) from None
    return factory(rng, **kwargs)


def demo_batches(
    env_id: str,
    env_kwargs: dict[str, Any],
    seeds: range,
    tokenizer: Any,
    make_turns: Callable[[], Any],
    demo_kwargs: dict[str, Any],
    max_turns: int,
    max_tokens: int,
) -> Callable[[random.Random, int], list[tuple[list[int], list[int]]]]:
    """A batch function for `rollwire.trainer.sft.warm_up_on`: scripted episodes as tokens."""
    from rollwire.envs import registry

    eos = int(tokenizer.eos_token_id)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def episode(rng: random.Random) -> tuple[list[int], list[int]]:
        env = registry.make(env_id, **env_kwargs)
        act = demonstrator(env_id, rng, **demo_kwargs)
        observation, info = env.reset(rng.choice(seeds))
        turns = make_turns()
        ids = turns.first(observation)
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
                following = turns.then(action, True, observation)
                if len(ids) + len(following) > max_tokens:
                    break
                ids += following
                taught += [0] * len(following)
        finally:
            env.close()
        return ids, taught

    def batch(rng: random.Random, size: int) -> list[tuple[list[int], list[int]]]:
        return [episode(rng) for _ in range(size)]

    return batch
