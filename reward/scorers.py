"""Scorers: functions from a response (and its reference) to a reward.

A scorer returns a `Score` with the reward and its named components. It may
raise; the reward-server then gives the item reward 0 with an error flag.
Each domain maps to one scorer in `SCORERS`, so the routing reads on one
screen (`rollwire.reward.table` adds the `code` domain, made from its sandbox settings);
a run can add its own with `reward_server.custom_scorers`
(`{domain: "package.module:function"}`).

Scorers run in worker processes (see `rollwire.reward.pool`), so heavy or
signal-based libraries (math-verify, reasoning-gym) are imported there, lazily.
"""

from __future__ import annotations

import importlib
import logging
import math
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
    image: bytes = b""
    """An image as the wire's msgpack array map (`rollwire.reward.images.image_of` reads
    and checks it; the image domains are in `rollwire.reward.table`); empty for text."""


ANSWER_FORMATS = ("tag", "boxed", "last_number", "whole")
"""Where the answer is in a response (`metadata.answer_format`, set by a dataset's
`answer_format`): the last `<answer>...</answer>` (the default), the last `\\boxed{...}`,
the last number, or the whole response."""
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_boxed(response: str) -> str | None:
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    depth, at = 0, start + len("\\boxed{")
    for index in range(at, len(response)):  # braces nest: \boxed{\frac{1}{2}}
        if response[index] == "{":
            depth += 1
        elif response[index] == "}":
            if depth == 0:
                return response[at:index].strip()
            depth -= 1
    return None


def extract_answer(response: str, answer_format: str = "tag") -> str | None:
    """The answer in `response` as `answer_format` says (see ANSWER_FORMATS), stripped; None
    if there is none."""
    if answer_format == "tag":
        found = _ANSWER.findall(response)
        return found[-1].strip() if found else None
    if answer_format == "boxed":
        return _last_boxed(response)
    if answer_format == "last_number":
        numbers = _NUMBER.findall(response)
        return numbers[-1].replace(",", "") if numbers else None
    if answer_format == "whole":
        return response.strip() or None
    raise ValueError(f"answer_format {answer_format!r} is not one of {list(ANSWER_FORMATS)}")


def item_answer(item: ScoreInput) -> str | None:
    """The item's answer, found as its `metadata.answer_format` says (default `tag`)."""
    answer_format = item.metadata.get("answer_format", "tag")
    if not isinstance(answer_format, str):
        raise ValueError(f"metadata.answer_format must be one of {list(ANSWER_FORMATS)}")
    return extract_answer(item.response, answer_format)


def _normalise(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def format_score(item: ScoreInput) -> Score:
    """1 when the response puts its answer in exactly one `<answer>` tag, else 0."""
    ok = len(_ANSWER.findall(item.response)) == 1
    return Score(float(ok), {"format": float(ok)})


def exact_match_score(item: ScoreInput) -> Score:
    """1 when the tagged answer equals the reference after case and space folding."""
    answer = item_answer(item)
    formatted = answer is not None
    correct = formatted and _normalise(answer) == _normalise(item.reference)
    return Score(float(correct), {"correct": float(correct), "format": float(formatted)})


MATH_OPTIONS = {
    "float_rounding": int,
    "numeric_precision": int,
    "strict": bool,
    "allow_set_relation_comp": bool,
    "timeout_seconds": int,
    "extraction": list,
}
"""What `metadata.math_verify` may set for one item: `verify`'s options, and `extraction`,
the kinds math-verify looks for in the response (`latex`, `expr`, `string`; default
`latex` and `expr`, math-verify's own default)."""


class _Records(logging.Handler):
    """Collects math-verify's log records during one item (it reports its timeouts there)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:200])


def _math_options(metadata: dict[str, Any]) -> tuple[dict[str, Any], list[Any] | None]:
    options = metadata.get("math_verify") or {}
    if not isinstance(options, dict):
        raise ValueError("metadata.math_verify must be a mapping of math-verify options")
    unknown = sorted(set(options) - MATH_OPTIONS.keys())
    if unknown:
        raise ValueError(
            f"metadata.math_verify has unknown options {unknown}; known: {sorted(MATH_OPTIONS)}"
        )
    verify_options: dict[str, Any] = {}
    for key, value in options.items():
        kind = MATH_OPTIONS[key]
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # numbers arrive from a Struct as floats
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"metadata.math_verify.{key} must be {kind.__name__}, got {value!r}")
        if key != "extraction":
            verify_options[key] = value
    if "extraction" not in options:
        return verify_options, None
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig

    kinds = {
        "latex": LatexExtractionConfig,
        "expr": ExprExtractionConfig,
        "string": StringExtractionConfig,
    }
    wanted = options["extraction"]
    if not wanted or any(kind not in kinds for kind in wanted):
        raise ValueError(
            f"metadata.math_verify.extraction must list some of {sorted(kinds)}, got {wanted!r}"
        )
    return verify_options, [kinds[kind]() for kind in wanted]


MAX_MATH_ANSWER_CHARS = 1000
"""A tagged answer longer than this is no answer (scored 0, `too_long`), never parsed."""
MAX_MATH_SEARCH_CHARS = 20_000
"""Without a tag, math-verify searches only this much of the end of the response."""


_FRACTION = re.compile(r"\s*-?\s*(\d+)\s*/\s*(\d+)\s*")


def _a_number(parsed: list[Any]) -> bool:
    """Whether math-verify's parse of an answer is a number as written: a number, or a
    fraction in lowest terms (1/2), not arithmetic that comes to one (40 + 2, 84/2)."""
    if getattr(parsed[0], "is_Number", False):
        return True
    written = parsed[-1] if isinstance(parsed[-1], str) else ""
    match = _FRACTION.fullmatch(written)
    return bool(match) and math.gcd(int(match[1]), int(match[2])) == 1 and match[2] != "1"


def math_score(item: ScoreInput) -> Score:
    """math-verify: the tagged answer (or, with no tag, the whole response) against the reference."""
    from math_verify import parse, verify

    if not item.reference.strip():
        raise ValueError("math items need a reference answer; this one has none")
    verify_options, extraction = _math_options(item.metadata)
    parse_options: dict[str, Any] = {} if extraction is None else {"extraction_config": extraction}
    if "timeout_seconds" in verify_options:
        parse_options["parsing_timeout"] = verify_options["timeout_seconds"]
    answer = item_answer(item)
    if answer is not None and len(answer) > MAX_MATH_ANSWER_CHARS:
        return Score(0.0, {"correct": 0.0, "format": 1.0, "extracted": 0.0, "too_long": 1.0})
    # Untagged, the answer is searched for near the end, where it is: a response of any
    # length costs the parser the same.
    candidate = answer if answer is not None else item.response[-MAX_MATH_SEARCH_CHARS:]
    records = _Records()
    logger = logging.getLogger("math_verify")
    # Its records (a timeout's repeats the whole input) come here, never to the service log.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(records)
    try:
        # Exactly math-verify's defaults where the item sets nothing: no wrapping in $...$,
        # which changes how some answers parse (1,22 or 1 000).
        gold = parse(item.reference, **parse_options)
        if not gold and "$" not in item.reference:
            # A bare LaTeX reference (\sqrt{2}) that the defaults find nothing in: read it as
            # math. Only the reference, and only then; the response is never rewrapped.
            gold = parse(f"${item.reference}$", **parse_options)
        guess = parse(candidate, **parse_options)
        correct = bool(gold) and bool(guess) and bool(verify(gold, guess, **verify_options))
        # A number is answered with a number: "40 + 2" (the question's own expression,
        # echoed) is equal to 42 but does not answer it.
        unworked = correct and getattr(gold[0], "is_Number", False) and not _a_number(guess)
        correct = correct and not unworked
    finally:
        logger.removeHandler(records)
    timeouts = [m for m in records.messages if m.startswith("Timeout")]
    if timeouts and not correct:
        raise TimeoutError(
            f"math-verify timed out ({timeouts[0].split(':')[0]}), so 0 is not a verdict"
        )
    if not gold:
        raise ValueError(f"math-verify found no answer in the reference {item.reference[:80]!r}")
    return Score(
        float(correct),
        {
            "correct": float(correct),
            "format": float(answer is not None),
            "extracted": float(bool(guess)),
            "unworked": float(unworked),
        },
    )


def reasoning_gym_score(item: ScoreInput) -> Score:
    """The task's own `score_answer` on the tagged answer; metadata must name `source_dataset`."""
    import reasoning_gym

    dataset = item.metadata.get("source_dataset")
    if not isinstance(dataset, str):
        raise ValueError(
            "reasoning_gym items need metadata.source_dataset (the reasoning-gym dataset name)"
        )
    answer = item_answer(item)
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
