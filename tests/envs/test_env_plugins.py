"""Env plugins: one `register` call makes an env and its warm-up demonstrator known everywhere."""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rollwire.envs import registry
from rollwire.envs.demos import demo_batches, demonstrator

PLUGIN = "plugin_env"


@pytest.fixture(scope="module")
def tokenizer():
    from rollwire.services.core.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def plugin_path(monkeypatch):
    """Makes tests/helpers/plugin_env.py importable, and forgets it afterwards so a later test's
    `load_plugins` imports, and so registers, it afresh."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "helpers"))
    yield PLUGIN
    module = sys.modules.pop(PLUGIN, None)
    for env_id in getattr(module, "ENV_IDS", ()):
        registry._REGISTRY.pop(env_id, None)


@pytest.fixture
def plugin(plugin_path):
    registry.load_plugins([plugin_path])
    return sys.modules[plugin_path]


def plain_turns(tokenizer):
    """What `PlainTurns` renders, without importing the orchestrator."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    class Turns:  # (tokens, the images they show): a text env shows none
        def first(self, observation: str, tools: Any = None) -> tuple[list[int], list]:
            return encode(f"{observation}\n"), []

        def then(
            self, action: str, stopped: bool, observation: str, role: str = "user"
        ) -> tuple[list[int], list]:
            return encode(f"{observation}\n"), []

    return Turns


def countdown_batches(tokenizer, env_id: str, **demo_kwargs):
    return demo_batches(
        env_id,
        {"highest": 4},
        range(100, 200),
        tokenizer,
        plain_turns(tokenizer),
        demo_kwargs,
        max_turns=8,
        max_tokens=200,
    )


def test_a_plugin_registers_its_env_and_demonstrator_in_one_call(plugin) -> None:
    specs = {spec.env_id: spec for spec in registry.list_specs()}
    assert specs[plugin.COUNTDOWN].description == "Count down to zero, one number a turn."
    assert registry.demonstrator(plugin.COUNTDOWN) is plugin.countdown_demonstrator
    assert registry.demonstrator(plugin.BARE_COUNTDOWN) is None
    assert plugin.COUNTDOWN in registry.ids_with_demonstrator()
    assert {"guess_the_number", "tool_use"} <= set(registry.ids_with_demonstrator())


def test_a_plugin_demonstrator_makes_warm_up_batches(plugin, tokenizer) -> None:
    batch = countdown_batches(tokenizer, plugin.COUNTDOWN)
    examples = batch(random.Random(0), 6)
    assert len(examples) == 6
    for ids, taught in examples:
        assert len(ids) == len(taught)
        prompt = tokenizer.decode(ids[: taught.index(1)])
        start = int(prompt.removeprefix("Count down from ").split(".")[0])
        actions = tokenizer.decode([t for t, m in zip(ids, taught, strict=True) if m])
        # A faultless demonstrator counts all the way down, one number a turn.
        assert actions.split("<eos>")[:-1] == [str(n) for n in range(start - 1, -1, -1)]


def test_demo_kwargs_reach_a_plugin_demonstrator(plugin, tokenizer) -> None:
    batch = countdown_batches(tokenizer, plugin.COUNTDOWN, slip_rate=1.0)
    for ids, taught in batch(random.Random(0), 4):
        prompt = tokenizer.decode(ids[: taught.index(1)])
        start = int(prompt.removeprefix("Count down from ").split(".")[0])
        actions = tokenizer.decode([t for t, m in zip(ids, taught, strict=True) if m])
        # It always slips, so its first number is wrong and ends the episode.
        assert actions.split("<eos>")[:-1] == [str(start - 2)]


def test_an_env_without_a_demonstrator_says_what_to_do(plugin, tokenizer) -> None:
    # At once, when the batch function is made: not after the model has been loaded.
    with pytest.raises(ValueError) as caught:
        countdown_batches(tokenizer, plugin.BARE_COUNTDOWN)
    message = str(caught.value)
    assert f"no scripted demonstrator for env {plugin.BARE_COUNTDOWN!r}" in message
    assert f"envs with one: {', '.join(registry.ids_with_demonstrator())}" in message
    assert "demonstrator=" in message and "warmup.steps: 0" in message


def test_an_unknown_env_points_at_the_plugins_setting() -> None:
    with pytest.raises(ValueError, match="'no_such_env': no env is registered.*env_server.plugins"):
        demonstrator("no_such_env", random.Random(0))


def test_rollwire_train_loads_the_plugins_before_warm_up(
    plugin_path, tokenizer, tmp_path, monkeypatch
) -> None:
    from rollwire.services.app.launcher import _warm_up_agent
    from rollwire.services.core.config import RunConfig
    from rollwire.services.core.tiny import TinySpec

    assert PLUGIN not in sys.modules  # only the launcher can make the env known
    base = tmp_path / "base"
    tokenizer.save_pretrained(base)
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(tmp_path / "cache"))
    drawn = []

    def warm_up_on(model_path, output_path, batch, steps, **_):
        drawn.extend(batch(random.Random(0), 3))
        output_path.mkdir()
        (output_path / "config.json").write_text("{}")
        return output_path

    # The real one trains with torch; this one only draws the examples it would train on.
    fake_sft = types.ModuleType("rollwire.trainer.pipelines.warmup")
    fake_sft.warm_up_on = warm_up_on
    monkeypatch.setitem(sys.modules, "rollwire.trainer.pipelines.warmup", fake_sft)
    config = RunConfig(
        env_server={"plugins": [PLUGIN]},
        orchestrator={"dataset": {"type": "env", "env_id": "plugin_countdown"}},
        warmup={"steps": 1, "dataset_size": 10},
    )
    target = _warm_up_agent(config, base, TinySpec(), progress=False)
    assert (target / "config.json").exists()
    assert len(drawn) == 3 and all(1 in taught for _, taught in drawn)
