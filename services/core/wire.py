"""The data plane's message schema: trajectories as frames, header first.

A trajectory frame is laid out so a relay reads what it needs without touching the
arrays:

    b"RWT\x02" | header length (u32, little-endian) | header | zero padding to 8 | arrays

The header is one msgpack map `{"schema": SCHEMA_VERSION, "kind": ..., "body": ...}`
whose array fields are `{"dtype": "<i4", "shape": [n], "at": offset}`; each array's raw
little-endian bytes lie at `offset` in the array region, in a fixed order
(`_SLOT_NAMES`, then `tensors`), each padded to 8 bytes, with nothing after the last. So
decoding unpacks a few hundred bytes of msgpack and views the arrays in place (no pickle,
nothing recomputed from text), and a relay may hold and pass on the frame's bytes
without copying them.

The first layout is still read everywhere, and is the simpler one to write from another
language: the same map with each array's bytes inline, `{"dtype", "shape", "data"}`, as
the whole frame (`encode_map`).

Several trajectory frames travel as one group frame (`rollwire.services.core.group_frame`).

Decoding is strict: a frame that is oversized, truncated, not msgpack, of another
schema version, of an unexpected kind, missing a field, carrying an unknown one,
whose arrays disagree in length or do not tile the array region raises `WireError` and
nothing else. A service can therefore answer any bytes it receives with one
`except WireError`.

Imports neither torch nor grpc; the trainer turns arrays into tensors itself.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import numpy as np

from rollwire.services.core.images import ImageError, ImageRef, of_wire, to_wire

SCHEMA_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

# Every array field has one dtype on the wire; encoders cast to it.
_ALLOWED_DTYPES = frozenset(
    {"|u1", "|i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "|b1"}
)


class WireError(ValueError):
    """A frame that cannot be decoded or does not follow the schema."""


# ---------------------------------------------------------------- arrays


def encode_array(array: np.ndarray, dtype: str) -> dict[str, Any]:
    """Packs an array as dtype, shape and raw little-endian bytes."""
    contiguous = np.ascontiguousarray(array, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(contiguous.shape), "data": contiguous.tobytes()}


def decode_array(
    value: Any, name: str, dtype: str | None = None, ndim: int | None = None, copy: bool = True
) -> np.ndarray:
    """Unpacks an array written by `encode_array`, checking dtype, shape and size (without
    `copy`: a read-only view of the frame's bytes). `value` may also be an array a
    header-first frame placed (`_place_arrays`): its dtype and dimensions are checked."""
    if type(value) is np.ndarray:
        _check_placed(value, name, dtype, ndim)
        return value.copy() if copy else value
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise WireError(f"{name}: expected an array map with dtype, shape and data")
    wire_dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(wire_dtype, str) or wire_dtype not in _ALLOWED_DTYPES:
        raise WireError(f"{name}: unsupported dtype {wire_dtype!r}")
    if dtype is not None and wire_dtype != dtype:
        raise WireError(f"{name}: dtype {wire_dtype} where {dtype} is required")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireError(f"{name}: shape must be a list of non-negative integers")
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{name}: {len(shape)} dimensions where {ndim} are required")
    if not isinstance(data, (bytes, memoryview)):
        raise WireError(f"{name}: data must be bytes")
    itemsize = np.dtype(wire_dtype).itemsize
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise WireError(
            f"{name}: {len(data)} bytes of data for shape {shape} ({expected} expected)"
        )
    array = np.frombuffer(data, dtype=np.dtype(wire_dtype)).reshape(shape)
    return array.copy() if copy else array


def _check_placed(array: np.ndarray, name: str, dtype: str | None, ndim: int | None) -> None:
    """An array placed from a header-first frame has the dtype and dimensions required."""
    if dtype is not None and array.dtype.str != dtype:
        raise WireError(f"{name}: dtype {array.dtype.str} where {dtype} is required")
    if ndim is not None and array.ndim != ndim:
        raise WireError(f"{name}: {array.ndim} dimensions where {ndim} are required")


def array_bytes(array: np.ndarray, dtype: str = "<f4") -> bytes:
    """An array as one msgpack array map (`encode_array`): how an image or latents travel
    in a proto's `bytes` field (`GenerateImages`, `ScoreItem.image`)."""
    return msgpack.packb(encode_array(array, dtype), use_bin_type=True)


def array_from_bytes(data: bytes, name: str) -> np.ndarray:
    """The array `array_bytes` wrote, checked as `decode_array` checks it; WireError saying
    what is wrong otherwise."""
    try:
        value = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises several unrelated types on bad bytes
        raise WireError(f"{name}: not valid msgpack ({type(error).__name__})") from None
    return decode_array(value, name)


# ---------------------------------------------------------------- messages


@dataclass(eq=False)
class Trajectory:
    """One episode, everything the trainer needs and nothing recomputed from text.

    Per-token arrays all have the episode's length T: the prompt, every
    generated turn and every observation or tool output, in order.
    """

    trajectory_id: str
    """Unique id; producers retry with the same id and the buffer deduplicates."""
    group_id: str
    """Samples of one prompt or seed share a group (for group-relative advantages)."""
    task_id: str
    """The task, prompt or environment seed this episode came from."""
    sample_index: int
    """Index of this sample within its group."""
    prompt_ordinal: int
    """Monotonic ordinal of the dataset prompt, for exactly-once accounting: one group per
    ordinal. Once the buffer has finished with an ordinal (trained or dropped), anything
    sent again under it is a duplicate, kept nowhere (counted in buffer_duplicates)."""
    source: str
    """Env id or dataset name."""
    domain: str
    """Domain used for scoring and batch composition ("math", "game", ...)."""
    token_ids: np.ndarray
    """int32 [T]: token ids of the whole episode."""
    loss_mask: np.ndarray
    """uint8 [T]: 1 on tokens the policy generated, 0 on prompt, observation, tool output."""
    behaviour_logprobs: np.ndarray
    """float32 [T]: the engine's logprob of each generated token, 0 elsewhere."""
    policy_versions: np.ndarray
    """int64 [T]: policy version that generated each token, -1 where loss_mask is 0."""
    reward: float
    """Final scalar reward of the episode."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Named parts of the final reward, for logging."""
    step_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """float32 [turns]: reward of each turn, for step-level advantages."""
    turn_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """int32 [T] or empty: the turn each generated token belongs to, -1 on every other
    token; empty for a single-turn episode."""
    turn_keys: list[str] = field(default_factory=list)
    """One key per turn naming the state the policy acted in (a digest of what it had
    seen); turns of one group with equal keys are compared by step-level advantages."""
    finish_reason: str = "stop"
    """Why the episode ended: "stop", "length", "abort", "terminated", "truncated", "error"."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase ("generate", "env", "score")."""
    trace_context: dict[str, str] = field(default_factory=dict)
    """W3C trace context (traceparent, tracestate) of the episode."""
    teacher_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """float32 [T] or empty: on-policy distillation's teacher logprob of each generated
    token (0 elsewhere), from a teacher rollout-server's ScoreTokens; empty otherwise."""
    kind: str = "tokens"
    """The modality the episode was generated in: "tokens", or "latents" (a diffusion
    model's denoising steps), carried unchanged so a relay such as the buffer moves any
    kind without decoding it."""
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    """Named arrays of any shape that a kind needs beside the per-step arrays; empty for
    tokens. A "latents" trajectory: each recorded denoising step is one "token" (its step
    index in `token_ids`, 1 in `loss_mask`, its log-probability and the policy version
    that took it), and `tensors` holds `latents` (float32 [R + 1, C, H, W], before each
    step and after the last) and `label` (int64 [1], what the sample was conditioned on)."""
    images: list[ImageRef] = field(default_factory=list)
    """The images a vision-language episode showed the model, in the order of their
    placeholders, each by value or by reference with its `offset` (the index of its first
    placeholder token): what the trainer's forward needs beside the token ids. Empty for
    a text episode (and left out of its frame)."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict) and f.name == "tensors":
                if mine.keys() != theirs.keys() or not all(
                    _same_array(mine[name], theirs[name]) for name in mine
                ):
                    return False
            elif isinstance(mine, np.ndarray):
                if not _same_array(mine, theirs):
                    return False
            elif mine != theirs:
                return False
        return True


def _same_array(a: np.ndarray, b: Any) -> bool:
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


@dataclass(eq=True)
class Batch:
    """Trajectories served to the trainer together, complete groups only."""

    batch_id: str
    """Unique id; the trainer acknowledges batches by it."""
    trainer_version: int
    """The trainer's policy version when the batch was assembled."""
    trajectories: list[Trajectory]
    """Whole groups, in group order."""


# Per-token arrays and their wire dtypes.
_TOKEN_ARRAYS = {
    "token_ids": "<i4",
    "loss_mask": "|u1",
    "behaviour_logprobs": "<f4",
    "policy_versions": "<i8",
}
_STRING_FIELDS = ("trajectory_id", "group_id", "task_id", "source", "domain", "finish_reason")
_INT_FIELDS = ("sample_index", "prompt_ordinal")
_TRAJECTORY_KEYS = frozenset(f.name for f in fields(Trajectory))
_OPTIONAL_KEYS = frozenset({"teacher_logprobs", "kind", "tensors", "images"})
"""Fields a frame may leave out (frames written before they existed): their defaults."""
_DEFAULT_KIND = "tokens"
"""The kind of a frame that names none. Encoding leaves it out, so a token trajectory's
frame is the same bytes as before the field existed, which older readers still accept."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wire_dtype(array: np.ndarray, name: str) -> str:
    """The little-endian wire dtype of a `tensors` array; TypeError for one the wire lacks."""
    dtype = np.asarray(array).dtype
    wire = dtype.newbyteorder("<").str
    if wire not in _ALLOWED_DTYPES:
        raise TypeError(f"tensors[{name!r}]: dtype {dtype} cannot go on the wire")
    return wire


def _trajectory_body(
    trajectory: Trajectory, array: Callable[[np.ndarray, str], dict[str, Any]] = encode_array
) -> dict[str, Any]:
    """The frame's body; `array` makes each array's map (`encode_array`: bytes inline)."""
    body: dict[str, Any] = {
        name: getattr(trajectory, name) for name in _STRING_FIELDS + _INT_FIELDS
    }
    for name, dtype in _TOKEN_ARRAYS.items():
        body[name] = array(getattr(trajectory, name), dtype)
    body["step_rewards"] = array(trajectory.step_rewards, "<f4")
    body["turn_ids"] = array(trajectory.turn_ids, "<i4")
    body["turn_keys"] = [str(key) for key in trajectory.turn_keys]
    body["reward"] = float(trajectory.reward)
    body["reward_components"] = {str(k): float(v) for k, v in trajectory.reward_components.items()}
    body["timings"] = {str(k): float(v) for k, v in trajectory.timings.items()}
    body["trace_context"] = {str(k): str(v) for k, v in trajectory.trace_context.items()}
    if trajectory.teacher_logprobs.size:
        body["teacher_logprobs"] = array(trajectory.teacher_logprobs, "<f4")
    if trajectory.tensors:
        body["tensors"] = {
            str(name): array(values, _wire_dtype(values, name))
            for name, values in trajectory.tensors.items()
        }
    if trajectory.kind != _DEFAULT_KIND:
        body["kind"] = str(trajectory.kind)
    if trajectory.images:
        body["images"] = [to_wire(image) for image in trajectory.images]
    return body


def _float_map(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise WireError(f"{name}: expected a map of names to numbers")
    for key, number in value.items():
        if (
            not isinstance(key, str)
            or not isinstance(number, (int, float))
            or isinstance(number, bool)
        ):
            raise WireError(f"{name}: expected a map of names to numbers")
        if not math.isfinite(number):
            raise WireError(f"{name}[{key!r}] is not finite")
    return {key: float(number) for key, number in value.items()}


def _check_fields(body: Any, where: str) -> None:
    """A trajectory body's keys are the schema's, its strings strings and its counts counts."""
    if not isinstance(body, dict):
        raise WireError(f"{where}: expected a map")
    keys = set(body) | _OPTIONAL_KEYS
    if keys != _TRAJECTORY_KEYS:
        missing, unknown = (
            sorted(_TRAJECTORY_KEYS - keys, key=str),
            sorted(keys - _TRAJECTORY_KEYS, key=str),
        )
        raise WireError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    for name in _STRING_FIELDS:
        if not isinstance(body[name], str):
            raise WireError(f"{where}.{name}: expected a string")
    for name in _INT_FIELDS:
        if type(body[name]) is not int or body[name] < 0:  # msgpack gives ints as int
            raise WireError(f"{where}.{name}: expected a non-negative integer")


def _finite_floats(value: Any) -> bool:
    """Whether `value` is a map of strings to finite floats, exactly those types."""
    if type(value) is not dict:
        return False
    for key, number in value.items():
        if type(key) is not str or type(number) is not float or not math.isfinite(number):
            return False
    return True


def _trace_context(trace: Any, where: str) -> dict[str, str]:
    if not isinstance(trace, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in trace.items()
    ):
        raise WireError(f"{where}.trace_context: expected a map of strings")
    return trace


_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})


def _view(value: Any, where: str, name: str, dtype: str) -> np.ndarray:
    """A read-only view of the 1-d array map `where.name` of `dtype`, checked as
    `decode_array` checks it (without copying: the caller copies what it keeps)."""
    if type(value) is np.ndarray:  # placed from a header-first frame
        _check_placed(value, f"{where}.{name}", dtype, 1)
        return value
    if value == _EMPTY[dtype]:  # the usual step_rewards and turn_ids of a one-turn episode
        return _EMPTY_ARRAY[dtype]
    # Three entries, and these three keys present: exactly the array map's keys.
    if type(value) is dict and len(value) == 3 and value.get("dtype") == dtype:
        shape, data = value.get("shape"), value.get("data")
        if type(shape) is list and len(shape) == 1 and type(data) in (bytes, memoryview):
            count = shape[0]
            if type(count) is int and count >= 0 and len(data) == count * _ITEMSIZE[dtype]:
                return np.frombuffer(data, dtype=_DTYPES[dtype])
    return decode_array(value, f"{where}.{name}", dtype, ndim=1)  # raises, saying what is wrong


_DTYPES = {dtype: np.dtype(dtype) for dtype in _ALLOWED_DTYPES}
_EMPTY = {dtype: {"dtype": dtype, "shape": [0], "data": b""} for dtype in _ALLOWED_DTYPES}
"""The wire form of an empty array of each dtype."""
_EMPTY_ARRAY = {dtype: np.frombuffer(b"", dtype=_DTYPES[dtype]) for dtype in _ALLOWED_DTYPES}
_ITEMSIZE = {dtype: np.dtype(dtype).itemsize for dtype in _ALLOWED_DTYPES}


_NO_VERSION = np.iinfo(np.int64).max
"""Where the minimum over the generated tokens' versions starts."""


@dataclass(slots=True)
class _Checked:
    """A trajectory body that passed every check, its arrays as views of the frame."""

    arrays: dict[str, np.ndarray]
    oldest_version: int | None
    """The oldest policy version among the generated tokens; None if none was generated."""
    step_rewards: np.ndarray
    turn_ids: np.ndarray
    teacher: np.ndarray | None
    trace: dict[str, str]
    kind: str
    tensors: dict[str, np.ndarray]
    images: list[ImageRef]


MAX_TENSORS = 16
"""Named arrays one trajectory may carry in `tensors`."""


def _tensors(value: Any, where: str) -> dict[str, np.ndarray]:
    """A body's `tensors` map, each array checked (views of the frame); {} when absent."""
    if value is None:
        return {}
    if type(value) is not dict or len(value) > MAX_TENSORS:
        raise WireError(f"{where}.tensors: expected a map of at most {MAX_TENSORS} named arrays")
    out = {}
    for name, array in value.items():
        if type(name) is not str or not name:
            raise WireError(f"{where}.tensors: names must be non-empty strings")
        out[name] = decode_array(array, f"{where}.tensors[{name!r}]", copy=False)
    return out


MAX_IMAGES = 64
"""Images one trajectory may carry."""


def _images(value: Any, where: str, tokens: int) -> list[ImageRef]:
    """A body's `images`, each a valid image whose offset lies in the episode, in order."""
    if value is None:
        return []
    if type(value) is not list or len(value) > MAX_IMAGES:
        raise WireError(f"{where}.images: expected a list of at most {MAX_IMAGES} images")
    out = []
    for index, item in enumerate(value):
        try:
            image = of_wire(item)
        except ImageError as error:
            raise WireError(f"{where}.images[{index}]: {error}") from None
        if not 0 <= image.offset < tokens or (out and image.offset <= out[-1].offset):
            raise WireError(
                f"{where}.images[{index}]: offset {image.offset} is not inside the episode's "
                f"{tokens} tokens after the image before it"
            )
        out.append(image)
    return out


def _check_body(body: Any, where: str) -> _Checked:
    """Every check a trajectory body must pass, without copying its arrays: what the
    buffer runs on each put (`admit`) and decoding runs before it copies (`decode`).

    On the buffer's hot path: each check is the cheapest one that is still exact (a
    byte translation for the 0/1 mask, one dot product for "all finite" with the exact
    check only when it says no, one masked reduction for the oldest version)."""
    _check_fields(body, where)
    arrays = {name: _view(body[name], where, name, dtype) for name, dtype in _TOKEN_ARRAYS.items()}
    mask, logprobs = arrays["loss_mask"], arrays["behaviour_logprobs"]
    tokens = mask.shape[0]
    if not (
        arrays["token_ids"].shape[0]
        == logprobs.shape[0]
        == arrays["policy_versions"].shape[0]
        == tokens
    ):
        lengths = {name: array.shape[0] for name, array in arrays.items()}
        raise WireError(f"{where}: per-token arrays differ in length {lengths}")
    mask_bytes = mask.tobytes()
    if mask_bytes.translate(None, b"\x00\x01"):
        raise WireError(f"{where}.loss_mask: values must be 0 or 1")
    generated = mask.view(np.bool_)  # 0 or 1 only, as just checked
    # The dot product is finite when every value is (or it overflowed: then the exact check).
    if not math.isfinite(logprobs.dot(logprobs)) and not np.isfinite(logprobs[generated]).all():
        raise WireError(f"{where}.behaviour_logprobs: not finite on a generated token")
    oldest = None
    if b"\x01" in mask_bytes:
        oldest = int(
            np.minimum.reduce(arrays["policy_versions"], where=generated, initial=_NO_VERSION)
        )
    if oldest is not None and oldest < 0:
        raise WireError(f"{where}.policy_versions: a generated token has no version")
    reward = body["reward"]
    if (
        not isinstance(reward, (int, float))
        or isinstance(reward, bool)
        or not math.isfinite(reward)
    ):
        raise WireError(f"{where}.reward: expected a finite number")
    step_rewards = _view(body["step_rewards"], where, "step_rewards", "<f4")
    if step_rewards.size and not np.isfinite(step_rewards).all():
        raise WireError(f"{where}.step_rewards: not finite")
    turn_ids = _view(body["turn_ids"], where, "turn_ids", "<i4")
    turn_keys = body["turn_keys"]
    if not isinstance(turn_keys, list) or not all(isinstance(k, str) for k in turn_keys):
        raise WireError(f"{where}.turn_keys: expected a list of strings")
    if turn_ids.size:
        if turn_ids.shape[0] != tokens:
            raise WireError(f"{where}.turn_ids: {turn_ids.shape[0]} entries for {tokens} tokens")
        if turn_ids.min() < -1 or turn_ids.max() >= max(len(turn_keys), 1):
            raise WireError(f"{where}.turn_ids: a turn id outside [-1, {len(turn_keys)})")
    trace = _trace_context(body["trace_context"], where)
    teacher = None
    if "teacher_logprobs" in body:
        teacher = _view(body["teacher_logprobs"], where, "teacher_logprobs", "<f4")
        if teacher.shape[0] != tokens:
            raise WireError(
                f"{where}.teacher_logprobs: {teacher.shape[0]} entries for {tokens} tokens"
            )
        if not np.isfinite(teacher[generated]).all():
            raise WireError(f"{where}.teacher_logprobs: not finite on a generated token")
    tensors = _tensors(body.get("tensors"), where)
    kind = body.get("kind", _DEFAULT_KIND)
    if not isinstance(kind, str) or not kind:
        raise WireError(f"{where}.kind: expected a non-empty string")
    for name in ("reward_components", "timings"):
        if not _finite_floats(body[name]):  # the usual case in one pass; else the full check
            _float_map(body[name], f"{where}.{name}")
    images = _images(body.get("images"), where, tokens)
    return _Checked(arrays, oldest, step_rewards, turn_ids, teacher, trace, kind, tensors, images)


def _trajectory_from_body(body: Any, where: str = "trajectory") -> Trajectory:
    checked = _check_body(body, where)
    teacher = checked.teacher
    return Trajectory(
        **{name: body[name] for name in _STRING_FIELDS + _INT_FIELDS},
        **{name: array.copy() for name, array in checked.arrays.items()},
        reward=float(body["reward"]),
        reward_components={k: float(v) for k, v in body["reward_components"].items()},
        step_rewards=checked.step_rewards.copy(),
        turn_ids=checked.turn_ids.copy(),
        turn_keys=list(body["turn_keys"]),
        timings={k: float(v) for k, v in body["timings"].items()},
        trace_context=dict(checked.trace),
        teacher_logprobs=np.zeros(0, np.float32) if teacher is None else teacher.copy(),
        tensors={name: array.copy() for name, array in checked.tensors.items()},
        kind=checked.kind,
        images=checked.images,
    )


# ---------------------------------------------------------------- headers


@dataclass(slots=True, eq=False)
class TrajectoryFrame:
    """A trajectory frame as a relay holds it: the bytes, plus what a relay needs to
    know about them, read without decoding the arrays (`peek`).

    The replay buffer admits, groups, orders and checks staleness on these fields and
    serves the bytes as they came; the consumer decodes them in full (`decode`), which
    is where a frame whose arrays break the schema is found.
    """

    trajectory_id: str
    group_id: str
    sample_index: int
    prompt_ordinal: int
    source: str
    domain: str
    oldest_version: int | None
    """The oldest policy version among the generated tokens; None if none was generated."""
    trace_context: dict[str, str]
    frame: bytes | memoryview
    """The frame as it came: a view of a larger message (a group frame) is kept, not copied."""

    @classmethod
    def of(cls, trajectory: Trajectory) -> TrajectoryFrame:
        """The frame of a trajectory (encodes it)."""
        return peek(encode(trajectory))

    def decode(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Trajectory:
        """The whole trajectory, checked in full; WireError if it breaks the schema."""
        return decode_trajectory(self.frame, max_frame_bytes)


_ENVELOPE_KEYS = frozenset({"schema", "kind", "body"})


def _unpack_envelope(frame: Any, max_frame_bytes: int) -> tuple[Any, Any]:
    """(kind, body) of a frame whose envelope is valid, in either layout (a header-first
    frame's arrays as views of it); WireError otherwise."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError(f"a frame must be bytes, not {type(frame).__name__}")
    if len(frame) > max_frame_bytes:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_frame_bytes}")
    region = None
    if frame[:4] == FRAME_MAGIC:
        view = memoryview(frame).cast("B") if isinstance(frame, memoryview) else memoryview(frame)
        if len(view) < _PREFIX.size:
            raise WireError(f"a frame of {len(view)} bytes is shorter than its prefix")
        _, length = _PREFIX.unpack_from(view)
        start = _PREFIX.size + length
        if start > len(view):
            raise WireError(f"a header of {length} bytes in a frame of {len(view)}")
        packed, region = view[_PREFIX.size : start], view[start + (-start % _ALIGN) :]
    else:
        packed = frame
    try:
        envelope = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types on bad input
        raise WireError(f"not a valid msgpack frame: {type(error).__name__}: {error}") from None
    if type(envelope) is not dict or envelope.keys() != _ENVELOPE_KEYS:
        raise WireError("not a rollwire frame: expected a map with schema, kind and body")
    if envelope["schema"] != SCHEMA_VERSION or not _is_int(envelope["schema"]):
        raise WireError(
            f"schema version {envelope['schema']!r} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    if region is not None:
        _place_arrays(envelope["body"], region)
    return envelope["kind"], envelope["body"]


FRAME_MAGIC = b"RWT\x02"
"""The first bytes of a header-first trajectory frame (a first-layout frame is a msgpack
map, whose first byte is 0x80-0x8f or 0xde-0xdf)."""
_PREFIX = struct.Struct("<4sI")  # magic, header length
_ALIGN = 8


_SLOT_NAMES = (*_TOKEN_ARRAYS, "step_rewards", "turn_ids", "teacher_logprobs")
"""The arrays of a body in the order their bytes lie in a header-first frame's array
region; then `tensors`, in the map's order."""


def _place_arrays(body: Any, region: memoryview) -> None:
    """Puts in place of each array's map the array itself, a read-only view of `region`,
    checking that the arrays tile the region in order; WireError otherwise. The body's
    checks then take the views as they would take the first layout's maps (what is
    missing or is no map is left to them to name)."""
    if type(body) is not dict:
        return
    whole = np.frombuffer(region, np.uint8)
    expected = 0
    for name in _SLOT_NAMES:
        if name in body:
            expected = _place(body, name, name, whole, expected)
    tensors = body.get("tensors")
    if type(tensors) is dict:
        for key in tensors:
            expected = _place(tensors, key, f"tensors[{key!r}]", whole, expected)
    if len(whole) != expected:
        raise WireError(f"trajectory: {len(whole)} bytes of arrays where they take {expected}")


def _place(holder: dict[str, Any], key: str, name: str, whole: np.ndarray, expected: int) -> int:
    """Places the array `holder[key]` whose bytes must start at `expected`; returns where
    the next one starts."""
    value = holder[key]
    dtype = shape = at = None
    if type(value) is dict and len(value) == 3:  # and these three keys: exactly them
        dtype, shape, at = value.get("dtype"), value.get("shape"), value.get("at")
    if dtype is None or shape is None or at is None:
        raise WireError(f"trajectory.{name}: expected an array map with dtype, shape and at")
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise WireError(f"trajectory.{name}: unsupported dtype {dtype!r}")
    one = type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0
    if one:
        count = shape[0]  # the usual case
    elif type(shape) is list and all(_is_int(d) and d >= 0 for d in shape):
        count = math.prod(shape)
    else:
        raise WireError(f"trajectory.{name}: shape must be a list of non-negative integers")
    if type(at) is not int or at != expected:
        raise WireError(f"trajectory.{name}: its bytes at {at!r}, where {expected} is next")
    end = at + count * itemsize
    if end > len(whole):
        raise WireError(
            f"trajectory.{name}: {end - at} bytes at {at} run past the {len(whole)} bytes of arrays"
        )
    array = whole[at:end].view(_DTYPES[dtype])
    holder[key] = array if one else array.reshape(shape)
    return end + (-end % _ALIGN)


def _raw_array(value: Any, name: str, dtype: str) -> np.ndarray:
    """A read-only view of a 1-d array map's data: dtype, shape and size checked, values not."""
    if type(value) is np.ndarray:  # placed from a header-first frame
        _check_placed(value, f"trajectory.{name}", dtype, 1)
        return value
    if not isinstance(value, dict) or value.get("dtype") != dtype:
        raise WireError(f"trajectory.{name}: expected a {dtype} array map")
    data, shape = value.get("data"), value.get("shape")
    if not isinstance(data, (bytes, memoryview)) or not isinstance(shape, list) or len(shape) != 1:
        raise WireError(f"trajectory.{name}: expected one dimension and bytes of data")
    itemsize = np.dtype(dtype).itemsize
    if not _is_int(shape[0]) or len(data) != shape[0] * itemsize:
        raise WireError(f"trajectory.{name}: {len(data)} bytes of data for shape {shape}")
    return np.frombuffer(data, dtype=np.dtype(dtype))


def peek(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> TrajectoryFrame:
    """A trajectory frame's identity, group, ordinal and oldest policy version, checked,
    without decoding or checking the rest of its arrays (about a quarter of `decode`'s
    cost). WireError if the frame is not a trajectory or those fields are wrong."""
    kind, body = _unpack_envelope(frame, max_frame_bytes)
    if kind != "trajectory":
        raise WireError(f"expected a trajectory frame, got kind {kind!r}")
    _check_fields(body, "trajectory")
    mask = _raw_array(body["loss_mask"], "loss_mask", _TOKEN_ARRAYS["loss_mask"])
    versions = _raw_array(
        body["policy_versions"], "policy_versions", _TOKEN_ARRAYS["policy_versions"]
    )
    if mask.shape != versions.shape:
        raise WireError("trajectory: loss_mask and policy_versions differ in length")
    trace = _trace_context(body["trace_context"], "trajectory")
    generated = versions[mask == 1]
    return _header(body, int(generated.min()) if generated.size else None, trace, frame)


def _header(
    body: dict[str, Any], oldest_version: int | None, trace: dict[str, str], frame: bytes
) -> TrajectoryFrame:
    """The TrajectoryFrame of a body whose header fields passed their checks; `oldest_version`:
    the oldest policy version among its generated tokens, None if none was generated."""
    return TrajectoryFrame(
        trajectory_id=body["trajectory_id"],
        group_id=body["group_id"],
        sample_index=body["sample_index"],
        prompt_ordinal=body["prompt_ordinal"],
        source=body["source"],
        domain=body["domain"],
        oldest_version=oldest_version,
        trace_context=trace,
        frame=frame if type(frame) in (bytes, memoryview) else bytes(frame),
    )


def admit(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> TrajectoryFrame:
    """A frame checked in full, as `decode_trajectory` checks it, and the header `peek`
    reads, without copying an array: what a relay keeps that must never pass on a frame
    its consumer would refuse. WireError if anything in it is wrong."""
    kind, body = _unpack_envelope(frame, max_frame_bytes)
    if kind != "trajectory":
        raise WireError(f"expected a trajectory frame, got kind {kind!r}")
    checked = _check_body(body, "trajectory")
    return _header(body, checked.oldest_version, checked.trace, frame)


# ---------------------------------------------------------------- frames


def encode(trajectory: Trajectory) -> bytes:
    """Encodes a trajectory as one header-first frame."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"cannot encode {type(trajectory).__name__}")
    chunks: list[Any] = []
    size = 0

    def place(array: np.ndarray, dtype: str) -> dict[str, Any]:
        nonlocal size
        contiguous = np.ascontiguousarray(array, dtype=_DTYPES[dtype])
        data = memoryview(contiguous).cast("B") if contiguous.size else b""
        at, size = size, size + len(data)
        chunks.append(data)
        if size % _ALIGN:
            chunks.append(_PADDING[-size % _ALIGN])
            size += -size % _ALIGN
        return {"dtype": dtype, "shape": list(contiguous.shape), "at": at}

    body = _trajectory_body(trajectory, place)
    header = msgpack.packb(
        {"schema": SCHEMA_VERSION, "kind": "trajectory", "body": body}, use_bin_type=True
    )
    start = _PREFIX.size + len(header)
    prefix = _PREFIX.pack(FRAME_MAGIC, len(header))
    return b"".join((prefix, header, _PADDING[-start % _ALIGN], *chunks))


_PADDING = [b"\0" * n for n in range(_ALIGN)]


def encode_map(trajectory: Trajectory) -> bytes:
    """Encodes a trajectory in the first layout: one msgpack map, arrays inline."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"cannot encode {type(trajectory).__name__}")
    body = _trajectory_body(trajectory)
    return msgpack.packb(
        {"schema": SCHEMA_VERSION, "kind": "trajectory", "body": body}, use_bin_type=True
    )


def decode_trajectory(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Trajectory:
    """Decodes one trajectory frame. Raises WireError, and only WireError, for anything
    invalid."""
    kind, body = _unpack_envelope(frame, max_frame_bytes)
    if kind != "trajectory":
        raise WireError(f"unknown frame kind {kind!r}")
    return _trajectory_from_body(body)
