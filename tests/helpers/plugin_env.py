"""An env plugin, as a user would write one: `env_server.plugins: [plugin_env]`.

It registers a tiny multi-turn env with its scripted demonstrator in one call,
so `rollwire train` can warm a model up on it, and the same env again without
one, to show what a run is told when there is none.
"""

from __future__ import annotations

import random
from typing import Any

from rollwire.envs.base import Act, Env, InvalidAction, StepResult
from rollwire.envs.registry import register

COUNTDOWN = "plugin_countdown"
BARE_COUNTDOWN = "plugin_countdown_bare"
ENV_IDS = (COUNTDOWN, BARE_COUNTDOWN)


class Countdown(Env):
    """Count down to zero from a seeded start, one number a turn; reward 1 for reaching it."""

    def __init__(self, highest: int = 4) -> None:
        self.highest = highest
        self._next: int | None = None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        start = random.Random(seed).randint(1, self.highest)
        self._next = start - 1
        return f"Count down from {start}.", {"start": start}

    def step(self, action: str) -> StepResult:
        if self._next is None:
            raise InvalidAction("call reset before step")
        if action.strip() != str(self._next):
            self._next = None
            return "wrong", 0.0, True, False, {}
        if self._next == 0:
            self._next = None
            return "done", 1.0, True, False, {}
        self._next -= 1
        return "next", 0.0, False, False, {}


def countdown_demonstrator(rng: random.Random, slip_rate: float = 0.0, **_: Any) -> Act:
    """Says the next number, or one too many `slip_rate` of the turns."""
    said: dict[str, int] = {}

    def act(observation: str, info: dict[str, Any]) -> str:
        said["last"] = said["last"] - 1 if said else int(info["start"]) - 1
        return str(said["last"] - 1 if rng.random() < slip_rate else said["last"])

    return act


register(
    COUNTDOWN,
    Countdown,
    "Count down to zero, one number a turn.",
    demonstrator=countdown_demonstrator,
)
register(BARE_COUNTDOWN, Countdown, "The same countdown, registered without a demonstrator.")
