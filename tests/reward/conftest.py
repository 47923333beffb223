"""Fixtures the reward tests share."""

from tests.helpers.judges import openai_judge  # noqa: F401 - a fixture, found by name
