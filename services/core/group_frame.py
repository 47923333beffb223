"""A group frame: several trajectory frames in one message, each readable in place.

    b"RWG\x02" | members (u32) | each member's length (u64) | the members back to back

`BufferProducer.put_group` sends a group as one; the buffer keeps each member as a view of
the message it received (`split_group`) and admits, logs and serves the members one by
one (`rollwire.services.core.wire`). A container only: what a member holds is the wire
schema's business.
"""

from __future__ import annotations

import struct

from rollwire.services.core.wire import DEFAULT_MAX_FRAME_BYTES, WireError

GROUP_MAGIC = b"RWG\x02"
"""The first bytes of a group frame."""
MAX_GROUP_MEMBERS = 65536
"""Trajectory frames one group frame may carry."""
_GROUP_PREFIX = struct.Struct("<4sI")  # magic, members
_MEMBER_LENGTH = struct.Struct("<Q")


def encode_group(frames: list[bytes]) -> bytes:
    """Several trajectory frames (`encode`'s) as one group frame."""
    if not 0 < len(frames) <= MAX_GROUP_MEMBERS:
        raise ValueError(
            f"a group frame carries 1 to {MAX_GROUP_MEMBERS} frames, not {len(frames)}"
        )
    lengths = b"".join(_MEMBER_LENGTH.pack(len(frame)) for frame in frames)
    return b"".join((_GROUP_PREFIX.pack(GROUP_MAGIC, len(frames)), lengths, *frames))


def is_group(frame: bytes | memoryview) -> bool:
    """Whether `frame` starts as a group frame does."""
    return frame[:4] == GROUP_MAGIC


def split_group(
    frame: bytes | memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> list[memoryview]:
    """The member frames of a group frame, as views of it (nothing copied; each member is
    checked when it is admitted or decoded). WireError if the group's own layout is wrong
    or a member is over `max_frame_bytes`."""
    view = memoryview(frame).cast("B") if isinstance(frame, memoryview) else memoryview(frame)
    if len(view) < _GROUP_PREFIX.size or view[:4] != GROUP_MAGIC:
        raise WireError("not a group frame")
    _, count = _GROUP_PREFIX.unpack_from(view)
    if not 0 < count <= MAX_GROUP_MEMBERS:
        raise WireError(f"a group frame of {count} members (1 to {MAX_GROUP_MEMBERS})")
    position = _GROUP_PREFIX.size + count * _MEMBER_LENGTH.size
    if position > len(view):
        raise WireError(f"a group frame of {len(view)} bytes is shorter than its {count} lengths")
    members = []
    for index in range(count):
        (length,) = _MEMBER_LENGTH.unpack_from(
            view, _GROUP_PREFIX.size + index * _MEMBER_LENGTH.size
        )
        if length > max_frame_bytes:
            raise WireError(
                f"group member {index}: {length} bytes exceed the limit of {max_frame_bytes}"
            )
        if position + length > len(view):
            raise WireError(f"group member {index}: {length} bytes run past the group's end")
        members.append(view[position : position + length])
        position += length
    if position != len(view):
        raise WireError(f"a group frame with {len(view) - position} bytes after its last member")
    return members
