"""What the distillation tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def teacher(tmp_path_factory) -> Path:
    """A digits teacher trained for 40 steps only (seconds, where the built-in one takes
    minutes), built once per worker: the distillation tests check their pipelines'
    mechanics, not their quality."""
    from rollwire.diffusion.digits import DigitsSpec, build_digits_model

    spec = DigitsSpec(block_out_channels=(8, 16), steps=40)
    return build_digits_model(tmp_path_factory.mktemp("teacher") / "digits", spec, progress=False)
