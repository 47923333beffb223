"""Text games."""

from __future__ import annotations

import random
import re
from typing import Any

from rollwire.envs.base import Env, InvalidAction, StepResult

_NUMBER = re.compile(r"-?\d+")


class GuessTheNumber(Env):
    """Find a hidden integer in [low, high] within `max_turns` guesses.

    Each action must contain an integer (the last one in the text is the
    guess). The reply is "higher", "lower" or "correct". Reward 1 for finding
    it, 0 otherwise; the episode is truncated after `max_turns` guesses.
    """

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 10) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, max_turns)):
            raise TypeError("low, high and max_turns must be integers")
        if low > high:
            raise ValueError(f"low ({low}) must not exceed high ({high})")
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.low, self.high, self.max_turns = low, high, max_turns
        self._target: int | None = None
        self._turns = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._target = random.Random(seed).randint(self.low, self.high)
        self._turns = 0
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high}. "
            f"You have {self.max_turns} guesses. Answer with a single number."
        )
        return prompt, {"low": self.low, "high": self.high, "max_turns": self.max_turns}

    def step(self, action: str) -> StepResult:
        if self._target is None:
            raise InvalidAction("call reset before step")
        numbers = _NUMBER.findall(action)
        if not numbers:
            raise InvalidAction(f"no integer in the action {action[:80]!r}")
        guess = int(numbers[-1])
        self._turns += 1
        info = {"guess": guess, "turn": self._turns}
        if guess == self._target:
            return "correct", 1.0, True, False, info
        hint = "higher" if guess < self._target else "lower"
        return hint, 0.0, False, self._turns >= self.max_turns, info
