"""The configuration reference, written from the config models themselves: every section
and key with its type, default and help (the field's docstring), so the documentation
cannot drift from the code. `rollwire config --reference` prints it; the documentation
site's build (`docs/hooks.py`) makes its page from it.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from rollwire.services.core.config import schema
from rollwire.services.core.config.models import RunConfig

INTRO = """\
Every key of a run's YAML file, by section. A key is set in the file
(`section: {key: value}`), by `--set section.key=value`, or by the environment
(`ROLLWIRE__SECTION__KEY=value`); `rollwire config` prints the whole configuration in
effect. A part chosen by `type` lists each of its types with the keys that type takes; a
bare type name stands for that type with its defaults (`--set trainer.algorithm.advantage=rloo`).
This page is generated from the config models' docstrings when the site is built.
"""


def markdown(root: type[BaseModel] = RunConfig) -> str:
    """The reference as one Markdown page."""
    out = ["# Configuration reference", "", INTRO]
    for name, field in root.model_fields.items():
        out.extend(_section(name, field.annotation, field.description, level=2))
    return "\n".join(out).rstrip() + "\n"


def _section(path: str, annotation: Any, help_text: str | None, level: int) -> Iterator[str]:
    heading = "#" * min(level, 4)
    tags = schema.tags(annotation)
    if tags:
        yield f"{heading} `{path}`"
        yield ""
        if help_text:
            yield _paragraph(help_text)
            yield ""
        yield f"Chosen by `type`: {', '.join(f'`{tag}`' for tag in tags)}."
        yield ""
        for member in schema.members(annotation):
            model = schema.model_of(member)
            tag = schema.tag(member)
            if model is None or tag is None:
                continue
            yield from _model(path, model, level + 1, title=f"`{path}` — `type: {tag}`")
        return
    model = schema.model_of(annotation)
    if model is None:
        return
    yield from _model(path, model, level, help_text=help_text)


def _model(
    path: str,
    model: type[BaseModel],
    level: int,
    help_text: str | None = None,
    title: str | None = None,
) -> Iterator[str]:
    heading = "#" * min(level, 4)
    yield f"{heading} {title or f'`{path}`'}"
    yield ""
    text = help_text or model.__doc__
    if text:
        yield _paragraph(text)
        yield ""
    rows, below = [], []
    for name, field in model.model_fields.items():
        child = f"{path}.{name}"
        inner = schema.model_of(field.annotation)
        if schema.tags(field.annotation) or (inner is not None and _is_section(field)):
            rows.append((name, "section", "", f"see [`{child}`](#{_anchor(child)})"))
            below.append((child, field))
            continue
        kind = _type(field.annotation) + _bounds(field.metadata)
        rows.append((name, kind, _default(field), field.description or ""))
    if rows:
        yield "| key | type | default | help |"
        yield "|---|---|---|---|"
        for name, kind, default, text in rows:
            yield f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(_paragraph(text))} |"
        yield ""
    for child, field in below:
        yield from _section(child, field.annotation, field.description, level + 1)


def _is_section(field: Any) -> bool:
    """A nested model shown as its own table (not one whose default is a list of them)."""
    origin = get_origin(schema.strip(field.annotation))
    return origin not in (list, tuple, dict)


def _anchor(path: str) -> str:
    """The id MkDocs gives a heading "`a.b_c`": lower case, dots and spaces dropped."""
    return "".join(ch for ch in path.lower() if ch.isalnum() or ch in "_-")


def _paragraph(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return " or ".join(_type(arg) for arg in get_args(annotation))
    if origin is Literal:
        return " or ".join(f"`{value!r}`" for value in get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        args = [arg for arg in get_args(annotation) if arg is not Ellipsis]
        inner = ", ".join(_type(arg) for arg in args)
        return f"{origin.__name__}[{inner}]"
    if origin is dict:
        key, value = get_args(annotation)
        return f"dict[{_type(key)}, {_type(value)}]"
    if annotation is type(None):
        return "null"
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(f"`{member.value!r}`" for member in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"section ({annotation.__name__})"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "min_length": "length ≥",
    "max_length": "length ≤",
}


def _bounds(metadata: list[Any]) -> str:
    """The field's constraints (`Field(gt=0)`), as `, > 0`."""
    found = []
    for item in metadata:
        for attribute, sign in _BOUNDS.items():
            value = getattr(item, attribute, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return "".join(f", {bound}" for bound in found)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    text = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    if isinstance(value, bool):
        text = str(value).lower()
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"
