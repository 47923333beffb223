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

The tests of the first two forms run in the same process as the program (as HumanEval's
own harness runs them): the sandbox bounds what the program can do to the machine, not to
its own result. Results travel on stdout tagged with a per-run random token the program is
not given; a program that goes looking for it in the harness's memory can forge a pass.
"""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from rollwire.reward.scorers import Score, ScoreInput
from rollwire.services.core.sandbox import Limits, Sandbox

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_OUTPUT_CHARS = 200_000

# Runs the program, then each test, in one namespace; argv: spec path. The first stdin
# line is the run's token; results are lines "<token> pass|fail <index> [reason]".
_HARNESS = r"""
import io, json, sys

def _main():
    token = sys.stdin.readline().strip()
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    report = sys.stdout
    sys.stdout = sys.stderr = io.StringIO()  # what the program prints is not the report
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(spec["program"], "solution.py", "exec"), namespace)
    except BaseException as error:
        report.write(f"{token} load {type(error).__name__}: {str(error)[:200]!r}\n")
        report.flush()
        return
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{index}", "exec"), namespace)
        except BaseException as error:
            report.write(f"{token} fail {index} {type(error).__name__}\n")
        else:
            report.write(f"{token} pass {index}\n")
        report.flush()
        sys.stdout.seek(0)
        sys.stdout.truncate()

_main()
"""


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
            tests, program = self._in_process_tests(program, item.prompt, metadata)
            passed, total, timed_out = self._harness(program, tests)
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
    def _in_process_tests(
        program: str, prompt: str, metadata: dict[str, Any]
    ) -> tuple[list[str], str]:
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
            return [f"{test}\ncheck({entry})"], program
        tests = metadata["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("metadata.tests must be a non-empty list of statements")
        setup = metadata.get("setup") or ""
        if not isinstance(setup, str):
            raise ValueError("metadata.setup must be text")
        return list(tests), f"{program}\n{setup}\n" if setup else program

    def _harness(self, program: str, tests: list[str]) -> tuple[int, int, bool]:
        token = secrets.token_hex(16)
        spec = json.dumps({"program": program, "tests": tests})
        limits = replace(self.limits, max_output_chars=_OUTPUT_CHARS)
        result = self.sandbox.run(
            ["{python}", "-I", "-S", "-c", _HARNESS, "{src}/spec.json"],
            files={"spec.json": spec},
            stdin=token + "\n",
            limits=limits,
        )
        passed = {
            int(parts[2])
            for line in result.output.splitlines()
            if (parts := line.split())
            and len(parts) >= 3
            and parts[0] == token
            and parts[1] == "pass"
        }
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
