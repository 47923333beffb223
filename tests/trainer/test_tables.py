"""The config's unions and the trainer's tables agree: every `type` a YAML file may name
has its table entry and back, every setting of an entry is a keyword of its function,
and no set of names is written down twice."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from rollwire.services.core.config import algorithms as settings
from rollwire.services.core.config import names
from rollwire.trainer.math import algorithms, losses
from rollwire.trainer.pipelines.table import PIPELINES
from rollwire.trainer.rl.advantages import SEQUENCE_ADVANTAGES, TOKEN_ADVANTAGES

ROOT = Path(__file__).resolve().parents[2]


def members(union: object) -> dict[str, type]:
    """The classes of a tagged union, by their tag."""
    annotated = typing.get_args(union)[0]
    out = {}
    for member in typing.get_args(annotated):
        cls, tag = typing.get_args(member)
        out[tag.tag] = cls
    return out


UNIONS = {
    "advantage": (settings.AdvantageConfig, {**SEQUENCE_ADVANTAGES, **TOKEN_ADVANTAGES}),
    "loss": (settings.PolicyLossConfig, losses.POLICY_LOSSES),
    "correction": (settings.CorrectionConfig, losses.CORRECTIONS),
}


@pytest.mark.parametrize("name", sorted(UNIONS))
def test_every_union_tag_is_its_class_type_and_a_table_key(name: str) -> None:
    union, table = UNIONS[name]
    classes = members(union)
    for tag, cls in classes.items():
        assert cls.model_fields["type"].default == tag, (name, cls.__name__)
    assert set(classes) == set(table), name


def test_every_estimator_and_loss_setting_is_a_keyword_of_its_function() -> None:
    pairs = [
        (members(settings.PolicyLossConfig), losses.POLICY_LOSSES),
        (members(settings.CorrectionConfig), losses.CORRECTIONS),
        (
            {
                k: v
                for k, v in members(settings.AdvantageConfig).items()
                if k in algorithms.ADVANTAGE_ESTIMATORS
            },
            algorithms.ADVANTAGE_ESTIMATORS,
        ),
    ]
    checked = 0
    for classes, table in pairs:
        for tag, cls in classes.items():
            parameters = inspect.signature(table[tag]).parameters
            for field in cls.model_fields:
                if field != "type":
                    assert field in parameters, f"{cls.__name__}.{field} is no keyword of {tag}"
                    checked += 1
    assert checked > 5  # the losses and corrections have settings: the loop ran over them


def test_the_named_literals_are_the_tables() -> None:
    assert set(typing.get_args(names.Aggregation)) == set(losses.AGGREGATIONS)
    assert set(typing.get_args(names.KLEstimator)) == set(losses.KL_ESTIMATORS)
    assert set(typing.get_args(names.ScheduleType)) == set(algorithms.SCHEDULES)
    assert set(typing.get_args(names.PreferenceLoss)) == set(losses.PREFERENCE_LOSSES)
    assert set(typing.get_args(names.SupervisedLoss)) == {"nll", *losses.DISTILL_LOSSES}


def test_no_literal_is_written_down_twice() -> None:
    """The same set of names in two `X = Literal[...]` aliases (or an alias and a field's
    own Literal of three names or more) is one list that will drift."""
    seen: dict[frozenset, str] = {}
    repeated = []
    for folder in ("services", "trainer", "rollout", "reward", "envs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not (
                    isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal"
                ):
                    continue
                elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                values = [e.value for e in elements if isinstance(e, ast.Constant)]
                if len(values) < 3:
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                key = frozenset(values)
                if key in seen:
                    repeated.append(f"{where} repeats {seen[key]}")
                else:
                    seen[key] = where
    assert seen, "found no Literal at all: the scan is broken"
    assert not repeated, repeated


def test_every_pipeline_names_a_section_a_program_and_a_family() -> None:
    from rollwire.services.core.config import RunConfig
    from rollwire.trainer.models import ModelFamily
    from rollwire.trainer.pipelines.table import load

    for name, pipeline in PIPELINES.items():
        assert pipeline.name == name
        assert pipeline.section in RunConfig.model_fields, name
        assert callable(load(pipeline.program)), name
        assert issubclass(load(pipeline.family), ModelFamily), name
        if pipeline.step:
            assert inspect.isclass(load(pipeline.step)), name
