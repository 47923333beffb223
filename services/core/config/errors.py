"""Validation errors told in the config's own words: each line names the key by the path a
user writes (`trainer.algorithm.advantage.kl_coef`, never pydantic's tag-qualified one), the
value given, and what is accepted there — the choices of a `type` or a literal, the keys of
a section (with the closest one to a misspelling), the form a value should take.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from rollwire.services.core.config import schema

_MAX_LISTED = 40
"""Longer lists of keys are not printed in full (the closest match still is)."""


def describe(error: ValidationError, root: type[BaseModel], source: str) -> str:
    """One line per error of `error`, validated against `root`, read from `source`."""
    lines = [f"invalid configuration ({source}):"]
    lines.extend(f"  {_line(item, root)}" for item in error.errors())
    return "\n".join(lines)


def _line(item: Any, root: type[BaseModel]) -> str:
    loc = tuple(item["loc"])
    path, annotation = _walk(root, loc)
    given = _given(item.get("input"))
    kind = item["type"]
    if kind == "extra_forbidden":
        parent_path, parent = _walk(root, loc[:-1])
        return (
            f"{path or '(top level)'}: unknown key{_keys_hint(str(loc[-1]), parent, parent_path)}"
        )
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = schema.tags(annotation)
        choices = ", ".join(tags) if tags else item.get("ctx", {}).get("expected_tags", "?")
        example = tags[0] if tags else "NAME"
        if kind == "union_tag_invalid":
            tag = item.get("ctx", {}).get("tag", given)
            return f"{path}: type {tag!r} is not one of: {choices}"
        return (
            f"{path}: expected a section with a `type`, or a type's name; got {given}. "
            f"The types: {choices} (`--set {path}={example}` is short for "
            f"`--set {path}.type={example}`)"
        )
    if kind in ("literal_error", "enum"):
        choices = schema.choices(annotation) or [item.get("ctx", {}).get("expected", "?")]
        return f"{path}: {given} is not accepted; choose one of: {', '.join(choices)}"
    if kind == "missing":
        return f"{path}: required, and not given"
    message = str(item["msg"]).removeprefix("Value error, ")
    message = message.replace("Input should be", "should be", 1)
    if given is None or isinstance(item.get("input"), dict):
        return f"{path or '(top level)'}: {message}"
    return f"{path}: {message} (given: {given})"


def _given(value: Any) -> str | None:
    if isinstance(value, dict):
        return None
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _keys_hint(key: str, parent: Any, parent_path: str) -> str:
    model = schema.model_of(parent)
    if model is None:
        return ""
    keys = list(model.model_fields)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75) or [
        known for known in keys if min(len(known), len(key)) >= 3 and key.startswith(known)
    ]
    if close:
        hint = f"; did you mean {close[0]!r}?"
    else:  # perhaps it lives deeper: `trainer.learning_rate` is `trainer.optimizer.learning_rate`
        deeper = _keys_below(model, parent_path)
        names = difflib.get_close_matches(key, {name for name, _ in deeper}, n=3, cutoff=0.75)
        paths = [path for name, path in deeper if name in names][:3]
        hint = f"; did you mean {' or '.join(paths)}?" if paths else ""
    where = f"{parent_path}'s keys" if parent_path else "the sections"
    if len(keys) <= _MAX_LISTED:
        hint += f" ({where}: {', '.join(keys)})"
    return hint


def _keys_below(model: type[BaseModel], path: str, depth: int = 3) -> list[tuple[str, str]]:
    """(key, its path) for every key of the sections under `model`, `depth` levels down."""
    found = []
    for name, field in model.model_fields.items():
        below = f"{path}.{name}" if path else name
        if path:
            found.append((name, below))
        if depth == 0:
            continue
        for member in [field.annotation, *map(schema.strip, schema.members(field.annotation))]:
            child = schema.model_of(member)
            if child is not None:
                found.extend(_keys_below(child, below, depth - 1))
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------- the schema at a path


def _walk(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, Any]:
    """The path a user writes for `loc`, and the annotation found there (None if lost)."""
    path = ""
    node: Any = root
    for part in loc:
        if node is not None:
            member = schema.tagged_member(node, part)
            if member is not None:  # pydantic's tag in the path: the user does not write it
                node = member
                continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
        node = schema.child(node, part) if node is not None else None
    return path, node
