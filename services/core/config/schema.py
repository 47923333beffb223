"""Reading the config models' annotations: the type inside `Annotated` and optionals, the
members and tags of a union on `type`, the model or literal choices at a key. What the
error messages (`errors.py`) and the configuration reference (`reference.py`) both walk."""

from __future__ import annotations

import enum
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Tag


def strip(annotation: Any) -> Any:
    """The type inside `Annotated[...]` and `X | None`."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def members(annotation: Any) -> list[Any]:
    annotation = strip(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return [arg for arg in get_args(annotation) if arg is not type(None)]
    return []


def tag(member: Any) -> str | None:
    if get_origin(member) is Annotated:
        for meta in get_args(member)[1:]:
            if isinstance(meta, Tag):
                return meta.tag
    return None


def tags(annotation: Any) -> list[str]:
    return [tag for tag in map(tag, members(annotation)) if tag is not None]


def tagged_member(annotation: Any, part: Any) -> Any:
    for member in members(annotation):
        if tag(member) == part:
            return strip(member)
    return None


def model_of(annotation: Any) -> type[BaseModel] | None:
    annotation = strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def child(annotation: Any, part: Any) -> Any:
    annotation = strip(annotation)
    model = model_of(annotation)
    if model is not None:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else None
    origin = get_origin(annotation)
    if origin in (list, tuple, set, frozenset) and isinstance(part, int):
        return get_args(annotation)[0]
    if origin is dict:
        return get_args(annotation)[1]
    for member in members(annotation):  # an untagged union: the first member that has it
        found = child(member, part)
        if found is not None:
            return found
    return None


def choices(annotation: Any) -> list[str]:
    """The accepted values of a literal or an enum (inside lists and optionals too)."""
    annotation = strip(annotation)
    if get_origin(annotation) in (list, tuple, set, frozenset):
        annotation = strip(get_args(annotation)[0])
    if get_origin(annotation) is Literal:
        return [repr(value) for value in get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [repr(member.value) for member in annotation]
    return []
