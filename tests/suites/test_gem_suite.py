"""Runs the GEM tests (marker `gem`) in their own environment, `.venv-gem`.

gem-llm 0.1.0 pins reasoning-gym 0.1.23 and reads as Python <= 3.12 only, so it
lives in a virtual environment of its own (no torch: rollwire[dev,env,reward,gem]).
`ROLLWIRE_GEM_PYTHON` names another interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.helpers.other_env import REPO, run_marked_tests

PYTHON = Path(os.environ.get("ROLLWIRE_GEM_PYTHON", REPO / ".venv-gem" / "bin" / "python"))


@pytest.mark.gem_suite
@pytest.mark.timeout(600)
def test_the_gem_tests_pass_in_their_environment() -> None:
    if importlib.util.find_spec("gem") is not None:
        pytest.skip("gem-llm is importable here: this session runs the gem-marked tests itself")
    run_marked_tests(PYTHON, "gem", ["tests/envs/test_env_catalogue.py"], timeout=540)
