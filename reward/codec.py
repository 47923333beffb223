"""Plain data across the wall between a program under test and the code that judges it.

The `code` domain runs a program and its tests in two sandboxes that share nothing but
two pipes. What crosses them is messages of plain data, written and read by this module:
None, bool, int, float (NaN and the infinities included), str, bytes, list, tuple,
dict, set and frozenset, nested. `decode` rebuilds exactly those types and checks each
on arrival: nothing the other side sends can become an object with behaviour of its own
(an `__eq__` that says yes to everything, a subclass of int, a callable). Anything else
is `CodecError`, which the judge counts as a failed test.

The format is a small typed one of our own, read without regular expressions or any
import beyond `math` (each sandboxed interpreter pays for what it imports, twice a
run): `n` None, `t`/`f` bools, `i<digits>;` ints, `d<repr>;` floats, `s<length>:<UTF-8>`
strings, `b<length>:<bytes>` bytes, and `[` list, `(` tuple, `{` set, `<` frozenset,
`m` dict (key, value, key, value...) each closed by `.`. A message is a dict, framed on
the pipe by its length in decimal digits and a newline. The module is shipped into both
sandboxes as a file (neither has rollwire installed).
"""

from __future__ import annotations

import math

# No `typing` and no `re` here: importing them costs each sandboxed interpreter
# milliseconds at start, twice a run.

MAX_DEPTH = 64
"""Nesting deeper than this is refused (a runaway recursion, or an attempt at one)."""
MAX_FRAME_BYTES = 16 * 2**20
"""The longest message either side reads; longer is refused, not read into memory."""
MAX_INT_DIGITS = 4000
"""Longer ints are refused (Python itself stops converting at 4300 digits)."""

_OPEN = {list: b"[", tuple: b"(", set: b"{", frozenset: b"<"}
_KINDS = {ord("["): list, ord("("): tuple, ord("{"): set, ord("<"): frozenset}
_END = ord(".")


class CodecError(ValueError):
    """A value that is not plain data, or bytes that do not decode to one."""


def encode(value: object) -> bytes:
    """`value` in the format above; CodecError for anything but plain data."""
    out: list[bytes] = []
    _encode(value, out, 0)
    return b"".join(out)


def _encode(value: object, out: list[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CodecError(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None:
        out.append(b"n")
    elif kind is bool:
        out.append(b"t" if value else b"f")
    elif kind is int:
        try:
            digits = str(value)
        except ValueError:
            raise CodecError("an int of more than 4300 digits") from None
        if len(digits) > MAX_INT_DIGITS:
            raise CodecError(f"an int of more than {MAX_INT_DIGITS} digits")
        out.append(b"i" + digits.encode() + b";")
    elif kind is float:
        out.append(b"d" + repr(value).encode() + b";")  # repr round-trips every float
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data) + data)
    elif kind is bytes:
        out.append(b"b%d:" % len(value) + value)
    elif kind in _OPEN:
        out.append(_OPEN[kind])
        for item in value:
            _encode(item, out, depth + 1)
        out.append(b".")
    elif kind is dict:
        out.append(b"m")
        for key, item in value.items():
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
        out.append(b".")
    else:
        raise CodecError(f"a {kind.__name__} is not plain data")


def decode(data: bytes) -> object:
    """The value `encode` wrote; CodecError for anything it cannot have written."""
    if type(data) is not bytes:
        raise CodecError("not bytes")
    value, at = _decode(data, 0, 0)
    if at != len(data):
        raise CodecError("bytes left over after the value")
    return value


def _number(data: bytes, at: int, limit: int) -> tuple[str, int]:
    """The ASCII text from `at` to the next `;` (at most `limit` long) and what follows."""
    end = data.find(b";", at, at + limit + 1)
    if end < 0:
        raise CodecError("a number without its end")
    return data[at:end].decode("ascii", "strict"), end + 1


def _length(data: bytes, at: int) -> tuple[int, int]:
    end = data.find(b":", at, at + 12)
    if end < 0 or not data[at:end].isdigit():
        raise CodecError("a bad length")
    size = int(data[at:end])
    if end + 1 + size > len(data):
        raise CodecError("a length past the end")
    return size, end + 1


def _decode(data: bytes, at: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise CodecError(f"nested deeper than {MAX_DEPTH}")
    if at >= len(data):
        raise CodecError("the data ends early")
    tag = data[at]
    at += 1
    if tag == ord("n"):
        return None, at
    if tag == ord("t"):
        return True, at
    if tag == ord("f"):
        return False, at
    try:
        if tag == ord("i"):
            text, at = _number(data, at, MAX_INT_DIGITS + 1)
            if not text.lstrip("-").isdigit() or text.startswith("--"):
                raise CodecError("a bad int")
            return int(text), at
        if tag == ord("d"):
            text, at = _number(data, at, 40)
            number = float(text)
            if not math.isfinite(number) and text not in ("nan", "inf", "-inf"):
                raise CodecError("a bad float")
            return number, at
    except (ValueError, UnicodeDecodeError) as error:
        if isinstance(error, CodecError):
            raise
        raise CodecError("a bad number") from None
    if tag in (ord("s"), ord("b")):
        size, at = _length(data, at)
        raw = data[at : at + size]
        if tag == ord("b"):
            return raw, at + size
        try:
            return raw.decode("utf-8", "surrogatepass"), at + size
        except UnicodeDecodeError:
            raise CodecError("a bad string") from None
    if tag in _KINDS:
        items = []
        while True:
            if at >= len(data):
                raise CodecError("a collection without its end")
            if data[at] == _END:
                at += 1
                break
            item, at = _decode(data, at, depth + 1)
            items.append(item)
        kind = _KINDS[tag]
        if kind is list:
            return items, at
        try:
            return kind(items), at
        except TypeError:
            raise CodecError(f"a {kind.__name__} of unhashable values") from None
    if tag == ord("m"):
        out = {}
        while True:
            if at >= len(data):
                raise CodecError("a dict without its end")
            if data[at] == _END:
                return out, at + 1
            key, at = _decode(data, at, depth + 1)
            item, at = _decode(data, at, depth + 1)
            try:
                out[key] = item
            except TypeError:
                raise CodecError("a dict with an unhashable key") from None
    raise CodecError(f"unknown tag {bytes([tag])!r}")


def write(stream, message: dict) -> None:
    """Sends one message (a dict of plain data) on a binary stream, framed."""
    data = encode(message)
    stream.write(b"%d\n" % len(data) + data)
    stream.flush()


def read(stream) -> dict:
    """The next message on a binary stream; EOFError at its end, CodecError if what
    arrives is not a message (too long, cut short, not plain data, not a dict)."""
    header = stream.readline(16)
    if not header:
        raise EOFError("the other side ended")
    if not header.endswith(b"\n") or not header[:-1].isdigit():
        raise CodecError("a bad frame header")
    size = int(header[:-1])
    if size > MAX_FRAME_BYTES:
        raise CodecError(f"a message over {MAX_FRAME_BYTES} bytes")
    data = stream.read(size)
    if len(data) != size:
        raise CodecError("a message cut short")
    message = decode(data)
    if type(message) is not dict:
        raise CodecError("a message that is not a dict")
    return message
