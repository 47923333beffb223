"""The plain-data codec between a program under test and its judge."""

from __future__ import annotations

import io
import math

import pytest

from rollwire.reward.codec import CodecError, decode, encode, read, write

PLAIN = [
    None,
    True,
    0,
    -(10**300),
    1.5,
    "text ü \n with a newline",
    b"\x00\xff\n",
    [1, [2, (3, {4})]],
    (),
    {"a": 1, 2: [3], (4, 5): frozenset({6})},
    {1.0, "x", None},
]


@pytest.mark.parametrize("value", PLAIN, ids=lambda value: type(value).__name__)
def test_plain_data_comes_back_as_itself(value) -> None:
    pipe = io.BytesIO()
    write(pipe, {"value": value})
    pipe.seek(0)
    back = read(pipe)["value"]
    assert back == value and type(back) is type(value)
    with pytest.raises(EOFError):
        read(pipe)


def test_the_floats_that_compare_oddly_cross_exactly() -> None:
    back = [decode(encode(x)) for x in (math.nan, math.inf, -math.inf, -0.0, 5e-324)]
    assert math.isnan(back[0]) and back[1:3] == [math.inf, -math.inf]
    assert math.copysign(1, back[3]) == -1 and back[4] == 5e-324


class Anything:
    def __eq__(self, other):
        return True


class Int(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize(
    "value",
    [Anything(), Int(3), [Int(3)], {"k": lambda: 1}, iter([1]), ValueError("x"), 10**5000],
    ids=["object", "int subclass", "nested subclass", "function", "iterator", "exception", "huge"],
)
def test_anything_but_plain_data_is_refused(value) -> None:
    with pytest.raises(CodecError):
        encode(value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"x",
        b"i12",  # no end
        b"i1" + b"1" * 5000 + b";",
        b"i--1;",
        b"i+1;",
        b"d1e400;",
        b"dnan();",
        b"s5:abc",  # a length past the end
        b"s3:\xff\xfe\xfd",
        b"[i1;",  # a list without its end
        b"{[.",  # a list in a set: unhashable
        b"m[.i1;.",
        b"nn",  # bytes left over
    ],
)
def test_what_encode_cannot_have_written_is_refused(data) -> None:
    with pytest.raises(CodecError):
        decode(data)


def test_depth_and_size_are_bounded() -> None:
    nested: list = []
    for _ in range(100):
        nested = [nested]
    with pytest.raises(CodecError, match="nested deeper"):
        encode(nested)
    with pytest.raises(CodecError, match="nested deeper"):
        decode(b"[" * 100 + b"." * 100)
    for frame in (b"99999999999\n", b"12x\n", b"5\nabc", b"3\n[i1"):
        with pytest.raises(CodecError):
            read(io.BytesIO(frame))
    with pytest.raises(CodecError, match="not a dict"):
        read(io.BytesIO(b"1\nn"))
