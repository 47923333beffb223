"""The `code` domain: run the response's program against the item's tests in the sandbox.

The program is the last fenced code block of the response (```python ... ``` or a bare
```), or the whole response when it has none. Tests come in the item's `metadata`, in one
of three forms:

- HumanEval: `entry_point` (the function's name) and `test` (code defining
  `check(candidate)`). When the program does not define the entry point, the prompt is
  put in front of it (a model that completes the prompt's function body).
- MBPP: `tests`, a list of statements (usually `assert`s), each run after the program,
  with an optional `setup` run before them.
- Input/output: `io`, a list of `{"input": ..., "output": ...}`: the program reads the
  input on stdin; its stdout must equal the output (trailing spaces on each line and
  trailing blank lines ignored). Each case is its own run, several at once.

Reward 1 when every test passes, else 0. Components: `passed` (the fraction of tests
that passed), `correct` (= reward), `format` (1 when the program came from a fenced
block), `timed_out` (1 when a run hit its time limit). An item that names no tests is
an error, not a zero.

The tests of the first two forms never share a process, a file or a secret with the
program: the program runs in one sandbox (`rollwire.reward.harness.program`), the tests
in another (`rollwire.reward.harness.judge`), connected by two pipes. In the judge each
function the program defines is a stand-in that sends its arguments and reads the answer
as plain data (`rollwire.reward.codec`: numbers, strings, bytes, None, bools, lists,
tuples, dicts, sets; each type checked on arrival). The judge alone decides: what the
program does to itself (its builtins, its output, its exit) changes only its answers,
and an answer that is not plain data fails the test that asked for it. A test that
needs the program's objects themselves (a class instance, a generator, a function
passed in) fails here too.
"""

from __future__ import annotations

import functools
import io
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rollwire.reward import codec
from rollwire.reward.scorers import Score, ScoreInput
from rollwire.services.core.sandbox import Limits, Sandbox

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_OUTPUT_CHARS = 200_000

_HERE = Path(__file__).parent
Runnable = tuple[list[str], dict[str, str | bytes]]
"""What `Sandbox.run` and `run_pair` take for one side: (argv, files)."""


@functools.cache
def _harness_sources() -> tuple[str, str, str]:
    """The judge's and the runner's scripts and the codec they share, read once."""
    return tuple(  # type: ignore[return-value]
        (_HERE / name).read_text()
        for name in ("harness/judge.py", "harness/program.py", "codec.py")
    )


def judged_pair(program: str, tests: list[str], setup: str = "") -> tuple[Runnable, Runnable]:
    """The judge's side and the program's side of a run (`Sandbox.run_pair`): each its
    `python -I -S` command and the files it sees; the tests only on the judge's."""
    judge, runner, codec_source = _harness_sources()
    return (
        (
            ["{python}", "-I", "-S", "{src}/judge.py", "{src}"],
            {
                "judge.py": judge,
                "codec.py": codec_source,
                "spec.bin": codec.encode({"tests": tests, "setup": setup}),
            },
        ),
        (
            ["{python}", "-I", "-S", "{src}/runner.py", "{src}"],
            {"runner.py": runner, "codec.py": codec_source, "solution.py": program},
        ),
    )


def passed_tests(verdict: bytes) -> set[int]:
    """The indices of the tests the judge's verdict says passed (none if it says none or
    is no verdict)."""
    try:
        report = codec.read(io.BytesIO(verdict))
    except (EOFError, codec.CodecError):
        return set()
    passed = report.get("passed")
    return {i for i in passed if type(i) is int} if type(passed) is list else set()


def extract_program(response: str) -> tuple[str, bool]:
    """The last fenced block's code (python, py, or unlabelled; else any), and whether one was found."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response, False
    python = [
        code for language, code in blocks if language.lower() in ("", "python", "py", "python3")
    ]
    return (python or [code for _, code in blocks])[-1], True


def _normalised_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


@dataclass
class CodeScorer:
    """Runs the response's program against the item's tests in the sandbox (HumanEval, MBPP or stdin/stdout)."""

    sandbox: Sandbox
    limits: Limits

    def __call__(self, item: ScoreInput) -> Score:
        metadata = item.metadata
        program, fenced = extract_program(item.response)
        if "io" in metadata:
            passed, total, timed_out = self._io(program, metadata["io"])
        elif "entry_point" in metadata or "tests" in metadata:
            tests, setup, program = self._judged_tests(program, item.prompt, metadata)
            passed, total, timed_out = self._judged(program, tests, setup)
        else:
            raise ValueError(
                "code items need tests in metadata: `entry_point` and `test` (HumanEval), "
                "`tests` (a list of asserts, MBPP) or `io` (a list of {input, output})"
            )
        correct = float(passed == total)
        return Score(
            correct,
            {
                "correct": correct,
                "passed": passed / total,
                "format": float(fenced),
                "timed_out": float(timed_out),
            },
        )

    @staticmethod
    def _judged_tests(
        program: str, prompt: str, metadata: dict[str, Any]
    ) -> tuple[list[str], str, str]:
        """(tests, the judge's setup, the program) of a HumanEval or MBPP item."""
        if "entry_point" in metadata:
            entry = metadata["entry_point"]
            test = metadata.get("test")
            if not isinstance(entry, str) or not isinstance(test, str):
                raise ValueError(
                    "HumanEval items need metadata.entry_point and metadata.test as text"
                )
            if not re.search(
                rf"^\s*(async\s+)?def\s+{re.escape(entry)}\s*\(", program, re.MULTILINE
            ):
                program = prompt + program
            return [f"{test}\ncheck({entry})"], "", program
        tests = metadata["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("metadata.tests must be a non-empty list of statements")
        setup = metadata.get("setup") or ""
        if not isinstance(setup, str):
            raise ValueError("metadata.setup must be text")
        return list(tests), setup, program

    def _judged(self, program: str, tests: list[str], setup: str) -> tuple[int, int, bool]:
        """Runs the program and the tests in two sandboxes (`Sandbox.run_pair`): the judge
        calls the program's functions with plain data and reads its answers as plain data
        (`rollwire.reward.codec`), and alone decides."""
        result = self.sandbox.run_pair(*judged_pair(program, tests, setup), self.limits)
        passed = passed_tests(result.verdict)
        return len(passed & set(range(len(tests)))), len(tests), result.timed_out

    def _io(self, program: str, cases: Any) -> tuple[int, int, bool]:
        if not isinstance(cases, list) or not cases:
            raise ValueError("metadata.io must be a non-empty list of {input, output}")
        for case in cases:
            if not isinstance(case, dict) or not isinstance(case.get("output"), str):
                raise ValueError("each metadata.io case needs `output` (text) and may have `input`")

        def one(case: dict[str, str]) -> tuple[bool, bool]:
            limits = replace(self.limits, max_output_chars=2 * len(case["output"]) + 1000)
            result = self.sandbox.run_python(program, limits, stdin=str(case.get("input", "")))
            return result.ok and not result.truncated and _normalised_output(
                result.output
            ) == _normalised_output(case["output"]), result.timed_out

        with ThreadPoolExecutor(min(len(cases), self.sandbox.max_parallel)) as pool:
            outcomes = list(pool.map(one, cases))
        return sum(ok for ok, _ in outcomes), len(cases), any(slow for _, slow in outcomes)
