"""Scorers: pure functions from a response (and its reference) to a reward.

A scorer returns a `Score` with the reward and its named components. It may
raise; the reward-server then gives the item reward 0 with an error flag.
Each domain maps to one scorer in `SCORERS`, so the routing reads on one screen.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Score:
    reward: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreInput:
    """One item to score; mirrors `rollwire.v1.ScoreItem`."""

    response: str
    reference: str = ""
    prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def extract_answer(response: str) -> str | None:
    """The text of the last `<answer>...</answer>` block, stripped; None if there is none."""
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def _normalise(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def format_score(item: ScoreInput) -> Score:
    """1 when the response puts its answer in exactly one `<answer>` tag, else 0."""
    ok = len(_ANSWER.findall(item.response)) == 1
    return Score(float(ok), {"format": float(ok)})


def exact_match_score(item: ScoreInput) -> Score:
    """1 when the tagged answer equals the reference after case and space folding."""
    answer = extract_answer(item.response)
    formatted = answer is not None
    correct = formatted and _normalise(answer) == _normalise(item.reference)
    return Score(float(correct), {"correct": float(correct), "format": float(formatted)})


SCORERS: dict[str, tuple[str, Callable[[ScoreInput], Score]]] = {
    "format": ("format_score", format_score),
    "exact_match": ("exact_match_score", exact_match_score),
}
"""domain -> (scorer name, scorer)."""
