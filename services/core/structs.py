"""Conversions between Python dicts and `google.protobuf.Struct`.

Struct stores every number as a double, so an integer sent as `8` arrives as
`8.0`; `from_struct` turns integral numbers back into ints, which is what env
kwargs and scorer metadata nearly always mean.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format, struct_pb2


def to_struct(data: dict[str, Any]) -> struct_pb2.Struct:
    """A Struct of `data`; values JSON cannot hold are written as their str()."""
    struct = struct_pb2.Struct()
    struct.update(json.loads(json.dumps(data, default=str)))
    return struct


def _restore_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _restore_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_restore_ints(item) for item in value]
    return value


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A plain dict of `struct`, with integral numbers as ints."""
    return _restore_ints(json_format.MessageToDict(struct))
