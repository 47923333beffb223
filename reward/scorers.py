"""Scorers: functions from a response (and its reference) to a reward.

A scorer returns a `Score` with the reward and its named components. It may
raise; the reward-server then gives the item reward 0 with an error flag.
Each domain maps to one scorer in `SCORERS`, so the routing reads on one
screen; a run can add its own with `reward_server.custom_scorers`
(`{domain: "package.module:function"}`).

Scorers run in worker processes (see `rollwire.reward.pool`), so heavy or
signal-based libraries (math-verify, reasoning-gym) are imported there, lazily.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollwire.services.core.config import SandboxConfig

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


def math_score(item: ScoreInput) -> Score:
    """1 when math-verify finds the tagged answer (or the whole response) equal to the reference."""
    from math_verify import parse, verify

    answer = extract_answer(item.response)
    candidate = answer if answer is not None else item.response
    gold = parse(item.reference if "$" in item.reference else f"${item.reference}$")
    guess = parse(candidate if "$" in candidate else f"${candidate}$")
    correct = bool(gold) and bool(guess) and bool(verify(gold, guess))
    return Score(float(correct), {"correct": float(correct), "format": float(answer is not None)})


def reasoning_gym_score(item: ScoreInput) -> Score:
    """The task's own `score_answer` on the tagged answer; metadata must name `source_dataset`."""
    import reasoning_gym

    dataset = item.metadata.get("source_dataset")
    if not isinstance(dataset, str):
        raise ValueError(
            "reasoning_gym items need metadata.source_dataset (the reasoning-gym dataset name)"
        )
    answer = extract_answer(item.response)
    entry = {"question": item.prompt, "answer": item.reference, "metadata": item.metadata}
    correct = (
        float(reasoning_gym.get_score_answer_fn(dataset)(answer, entry))
        if answer is not None
        else 0.0
    )
    return Score(correct, {"correct": correct, "format": float(answer is not None)})


SCORERS: dict[str, tuple[str, Callable[[ScoreInput], Score]]] = {
    "format": ("format_score", format_score),
    "exact_match": ("exact_match_score", exact_match_score),
    "math": ("math_score", math_score),
    "reasoning_gym": ("reasoning_gym_score", reasoning_gym_score),
}
"""domain -> (scorer name, scorer)."""


def load_scorer(spec: str) -> Callable[[ScoreInput], Score]:
    """Imports `package.module:function`."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"scorer {spec!r} must look like package.module:function")
    function = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(function):
        raise ValueError(f"{spec!r} is not a function")
    return function


def code_scorer(sandbox: SandboxConfig) -> Callable[[ScoreInput], Score]:
    """The `code` domain's scorer on `sandbox`; raises SandboxUnavailable where it cannot run."""
    from rollwire.reward.code import CodeScorer
    from rollwire.services.core.sandbox import Limits, Sandbox

    return CodeScorer(
        Sandbox(sandbox.kind, max_parallel=sandbox.max_parallel, python=sandbox.python),
        Limits(
            timeout_s=sandbox.timeout_seconds,
            memory_mb=sandbox.memory_mb,
            file_mb=sandbox.file_mb,
            processes=sandbox.processes,
        ),
    )


def scorer_table(
    custom: dict[str, str], sandbox: SandboxConfig | None = None
) -> dict[str, tuple[str, Callable[[ScoreInput], Score]]]:
    """Built-in scorers, the `code` domain on `sandbox` (when given), and the configured
    custom ones (which may override a built-in domain)."""
    table = dict(SCORERS)
    if sandbox is not None:
        table["code"] = (f"code_score ({sandbox.kind} sandbox)", code_scorer(sandbox))
    for domain, spec in custom.items():
        table[domain] = (spec, load_scorer(spec))
    return table
