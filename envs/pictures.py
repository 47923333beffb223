"""Environments whose observations are pictures, for vision-language policies.

`DigitLock` is a lock of a few dials, each showing a handwritten digit (scikit-learn's
8x8 digits, drawn as a PNG): the policy opens the dial in view by naming its digit, and
only the picture says which digit that is. A wrong digit leaves the dial shut and shows
it again; the episode ends when every dial is open or the turns run out. Each dial
opened pays 1/dials, so the episode's reward is the share of the lock opened, and every
wrong try costs a turn the later dials may need.

The `train` split draws its digits from images 0-1499, `held_out` from the other 297:
an evaluation on `held_out` shows the policy pictures training never did.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollwire.envs.base import Act, Env, InvalidAction, Observation, StepResult, parts
from rollwire.envs.games import int_kwarg, require_episode

_DIGIT = re.compile(r"\d")


class DigitLock(Env):
    """Open `dials` dials by naming the digit each one shows; `max_turns` tries in all."""

    def __init__(self, dials: int = 2, split: str = "train", max_turns: int | None = None) -> None:
        from rollwire.services.core.datasets import Digits

        self.dials = int_kwarg("dials", dials, minimum=1, maximum=8)
        self.max_turns = int_kwarg(
            "max_turns", 2 * self.dials if max_turns is None else max_turns, minimum=self.dials
        )
        self.digits = Digits.load()
        self.pool = self.digits.split(split)
        self.shown: list[int] = []  # the digit image of each dial
        self.opened = 0
        self.turns = 0
        self.started = False
        self.done = False

    def _observation(self, feedback: str) -> Observation | str:
        if self.opened == self.dials:
            return f"{feedback} all {self.dials} open."
        dial = f"dial {self.opened + 1}/{self.dials}?"
        return Observation(f"{feedback} {dial}" if feedback else dial, (self._picture(),))

    def _picture(self) -> Any:
        return self.digits.picture(self.shown[self.opened])

    def _info(self) -> dict[str, Any]:
        if self.opened == self.dials:
            return {}
        index = self.shown[self.opened]
        # The state a turn acts in: which dial, showing which picture (for step advantages);
        # the reference is for scripted players, never shown to the policy.
        return {"state_key": f"{self.opened}:{index}", "reference": str(self.digits.label(index))}

    def reset(self, seed: int | None = None) -> tuple[str | Observation, dict[str, Any]]:
        rng = random.Random(seed)
        self.shown = [rng.choice(self.pool) for _ in range(self.dials)]
        self.opened, self.turns, self.started, self.done = 0, 0, True, False
        return self._observation(""), self._info()

    def step(self, action: str) -> StepResult:
        require_episode(self.started, self.done)
        found = _DIGIT.findall(action)
        if not found:
            raise InvalidAction(f"no digit in the action {action[:80]!r}; name the digit shown")
        self.turns += 1
        right = int(found[-1]) == self.digits.label(self.shown[self.opened])
        if right:
            self.opened += 1
        terminated = self.opened == self.dials
        truncated = not terminated and self.turns >= self.max_turns
        self.done = terminated or truncated
        observation = self._observation("open." if right else "no.")
        return (
            observation,
            (1.0 / self.dials if right else 0.0),
            terminated,
            truncated,
            self._info(),
        )


def digit_lock_demonstrator(rng: random.Random, off_by_one_rate: float = 0.6, **_: Any) -> Act:
    """DigitLock's scripted player, for warm-up: names each dial's digit, the next one up
    (wrapping 9 to 0) `off_by_one_rate` of its first tries, and the right one after a miss."""

    def act(observation: str | Observation, info: dict[str, Any]) -> str:
        digit = int(info["reference"])
        retry = parts(observation)[0].startswith("no.")
        if not retry and rng.random() < off_by_one_rate:
            digit = (digit + 1) % 10
        return str(digit)

    return act
