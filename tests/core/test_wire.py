"""The data-plane schema: round trips, and garbage that must raise WireError only."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollwire.services.core.group_frame import encode_group, split_group
from rollwire.services.core.wire import (
    SCHEMA_VERSION,
    Trajectory,
    WireError,
    admit,
    decode_trajectory,
    encode,
    encode_map,
    peek,
)

names = st.text(max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    length = draw(st.integers(0, 40))
    mask = np.array(
        draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)), dtype=np.uint8
    )
    logprobs = np.array(
        draw(st.lists(st.floats(-30, 0, width=32), min_size=length, max_size=length)), np.float32
    )
    versions = np.array(
        draw(st.lists(st.integers(0, 2**40), min_size=length, max_size=length)), np.int64
    )
    return Trajectory(
        trajectory_id=draw(names),
        group_id=draw(names),
        task_id=draw(names),
        sample_index=draw(st.integers(0, 1000)),
        prompt_ordinal=draw(st.integers(0, 2**62)),
        source=draw(names),
        domain=draw(names),
        token_ids=np.array(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length)), np.int32
        ),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, logprobs, 0).astype(np.float32),
        policy_versions=np.where(mask == 1, versions, -1).astype(np.int64),
        reward=draw(finite),
        reward_components=draw(st.dictionaries(names, finite, max_size=3)),
        step_rewards=np.array(draw(st.lists(finite, max_size=5)), np.float32),
        turn_ids=np.where(mask == 1, 1, -1).astype(np.int32)
        if draw(st.booleans())
        else np.zeros(0, np.int32),
        turn_keys=["first", "second"],
        finish_reason=draw(st.sampled_from(["stop", "length", "abort", "terminated"])),
        timings=draw(st.dictionaries(names, st.floats(0, 1e4), max_size=3)),
        trace_context=draw(st.dictionaries(names, names, max_size=2)),
        teacher_logprobs=np.where(mask == 1, logprobs - 1, 0).astype(np.float32)
        if draw(st.booleans())
        else np.zeros(0, np.float32),
        kind=draw(st.sampled_from(["tokens", "latents"])),
        tensors=draw(
            st.sampled_from(
                [
                    {},
                    {
                        "latents": np.arange(8, dtype=np.float32).reshape(2, 1, 2, 2),
                        "label": np.array([3], np.int64),
                    },
                ]
            )
        ),
    )


def sample(length: int = 6) -> Trajectory:
    mask = np.array([0, 0, 1, 1, 0, 1][:length], np.uint8)
    return Trajectory(
        trajectory_id="t-1",
        group_id="g-1",
        task_id="task-9",
        sample_index=0,
        prompt_ordinal=41,
        source="gsm8k",
        domain="math",
        token_ids=np.arange(length, dtype=np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32),
        policy_versions=np.where(mask == 1, 3, -1).astype(np.int64),
        reward=1.0,
        reward_components={"correct": 1.0},
        step_rewards=np.array([0.0, 1.0], np.float32),
        turn_ids=np.array([-1, -1, 0, 0, -1, 1][:length], np.int32),
        turn_keys=["s0", "s1"],
        finish_reason="stop",
        timings={"generate": 0.25},
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )


@given(trajectories())
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_trajectory_round_trip(trajectory: Trajectory) -> None:
    for frame in (encode(trajectory), encode_map(trajectory)):  # both layouts
        decoded = decode_trajectory(frame)
        assert decoded == trajectory
        assert decoded.token_ids.dtype == np.int32
        assert decoded.policy_versions.dtype == np.int64


def header(frame: bytes) -> dict:
    """The msgpack map of a frame in either layout (a header-first frame's header)."""
    if frame[:4] != b"RWT\x02":
        return msgpack.unpackb(frame, raw=False)
    (length,) = struct.unpack_from("<I", frame, 4)
    return msgpack.unpackb(frame[8 : 8 + length], raw=False)


def test_arrays_travel_as_little_endian_bytes_after_the_header() -> None:
    frame = encode(sample())
    envelope = header(frame)
    assert envelope["schema"] == SCHEMA_VERSION
    token_ids = envelope["body"]["token_ids"]
    assert token_ids == {"dtype": "<i4", "shape": [6], "at": 0}
    start = 8 + struct.unpack_from("<I", frame, 4)[0]
    start += -start % 8
    assert frame[start : start + 24] == np.arange(6, dtype="<i4").tobytes()
    inline = header(encode_map(sample()))["body"]["token_ids"]
    assert inline["data"] == np.arange(6, dtype="<i4").tobytes()


def _header_first(mutate) -> bytes:
    """A sample's header-first frame with its header changed by `mutate`."""
    frame = encode(sample())
    (length,) = struct.unpack_from("<I", frame, 4)
    start = 8 + length
    envelope = msgpack.unpackb(frame[8:start], raw=False)
    arrays = frame[start + (-start % 8) :]
    region = mutate(envelope, arrays)
    packed = msgpack.packb(envelope, use_bin_type=True)
    pad = b"\0" * (-(8 + len(packed)) % 8)
    return b"RWT\x02" + struct.pack("<I", len(packed)) + packed + pad + region


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e, r: r + b"\0" * 8, "bytes of arrays where they take"),
        (lambda e, r: r[:-8], "run past the"),
        (lambda e, r: e["body"]["token_ids"].update(at=8) or r, "where 0 is next"),
        (lambda e, r: e["body"]["token_ids"].update(at=0.0) or r, "where 0 is next"),
        (lambda e, r: e["body"]["loss_mask"].update(data=b"\0" * 6) or r, "dtype, shape and at"),
        (lambda e, r: e["body"]["loss_mask"].update(dtype="O") or r, "unsupported dtype"),
        (lambda e, r: e["body"]["loss_mask"].update(shape=[-1]) or r, "non-negative"),
        (lambda e, r: e["body"]["loss_mask"].update(shape=[2**60]) or r, "run past the"),
        (lambda e, r: e["body"].update(tensors={"x": 1}) or r, r"tensors\['x'\]: expected an"),
    ],
)
def test_a_header_first_frame_whose_arrays_do_not_tile_its_region_is_refused(
    mutate, message: str
) -> None:
    assert decode_trajectory(_header_first(lambda e, r: r)) == sample()  # unchanged: reads
    frame = _header_first(mutate)
    for read in (peek, admit, decode_trajectory):
        with pytest.raises(WireError, match=message):
            read(frame)


def test_a_header_length_past_the_frame_is_refused() -> None:
    frame = bytearray(encode(sample()))
    struct.pack_into("<I", frame, 4, len(frame))
    with pytest.raises(WireError, match="a header of"):
        decode_trajectory(bytes(frame))
    with pytest.raises(WireError, match="shorter than its prefix"):
        decode_trajectory(b"RWT\x02\0")


def test_a_group_frame_carries_its_members_as_views() -> None:
    """A group travels as one frame; the buffer keeps each member as a view of it (no
    copy) and each member decodes alone, in either layout."""
    members = [sample(), sample(4), sample(1)]
    members[1].trajectory_id, members[2].trajectory_id = "t-2", "t-3"
    frames = [encode(members[0]), encode_map(members[1]), encode(members[2])]
    group = encode_group(frames)
    split = split_group(group)
    assert [bytes(view) for view in split] == frames
    assert all(view.obj is group for view in split)  # views of the message, not copies
    assert [admit(view).decode() for view in split] == members
    assert [decode_trajectory(view) for view in split] == members
    with pytest.raises(ValueError, match="1 to"):
        encode_group([])
    lengths = 8 + 8 * len(frames)
    for broken, message in (
        (group[:-1], "run past the group's end"),
        (group + b"\0", "after its last member"),
        (group[:10], "shorter than its 3 lengths"),
        (b"RWG\x02" + struct.pack("<I", 0), "of 0 members"),
        (b"RWT\x02" + group[4:], "not a group frame"),
        (group[:8] + struct.pack("<Q", 2**63) + group[16:lengths], "exceed the limit"),
    ):
        with pytest.raises(WireError, match=message):
            split_group(broken)
    assert len(split_group(group, max_frame_bytes=max(map(len, frames)))) == 3
    with pytest.raises(WireError, match="exceed the limit"):
        split_group(group, max_frame_bytes=max(map(len, frames)) - 1)


@given(st.binary(max_size=512))
@settings(max_examples=400)
def test_garbage_raises_wire_error_only(garbage: bytes) -> None:
    try:
        decoded = decode_trajectory(garbage)
    except WireError as error:
        assert str(error)  # every rejection says why
    else:
        assert isinstance(decoded, Trajectory)


def mutated(data: st.DataObject) -> bytes:
    """A sample's frame, in either layout, with one to four bytes overwritten."""
    frame = bytearray(data.draw(st.sampled_from([encode, encode_map]))(sample()))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    return bytes(frame)


@given(st.data())
@settings(max_examples=300)
def test_mutated_frames_raise_wire_error_or_decode(data: st.DataObject) -> None:
    frame = mutated(data)
    try:
        decoded = decode_trajectory(frame)
    except WireError:
        return
    # A mutation that still decodes must still satisfy the schema's invariants.
    if isinstance(decoded, Trajectory):
        assert decoded.token_ids.shape == decoded.loss_mask.shape == decoded.policy_versions.shape
        assert math.isfinite(decoded.reward)


@given(st.integers(0, 400), st.sampled_from([encode, encode_map]))
def test_every_truncation_raises_wire_error(cut: int, layout) -> None:
    frame = layout(sample())
    cut = min(cut, len(frame) - 1)
    with pytest.raises(WireError):
        decode_trajectory(frame[:cut])


def _frame(mutate) -> bytes:
    """A sample's frame in the first layout (every field in one msgpack map), changed by
    `mutate`: the checks of the body are the same in both layouts."""
    envelope = msgpack.unpackb(encode_map(sample()), raw=False)
    mutate(envelope)
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e.update(schema=2), "schema version 2 is not supported"),
        (lambda e: e.update(schema=True), "schema version True is not supported"),
        (lambda e: e.update(kind="weights"), "unknown frame kind 'weights'"),
        (lambda e: e["body"].pop("reward"), r"missing fields \['reward'\]"),
        (lambda e: e["body"].update(extra=1), r"unknown fields \['extra'\]"),
        (lambda e: e["body"]["token_ids"].update(dtype="<i8"), "dtype <i8 where <i4 is required"),
        (lambda e: e["body"]["token_ids"].update(dtype="O"), "unsupported dtype 'O'"),
        (lambda e: e["body"]["token_ids"].update(shape=[7]), "bytes of data for shape"),
        (
            lambda e: e["body"]["token_ids"].update(shape=[2, 3], data=b"\0" * 24),
            "2 dimensions where 1",
        ),
        (
            lambda e: e["body"]["loss_mask"].update(shape=[5], data=b"\0" * 5),
            "per-token arrays differ in length",
        ),
        (lambda e: e["body"]["loss_mask"].update(data=b"\2" * 6), "values must be 0 or 1"),
        (lambda e: e["body"].update(reward=float("nan")), "reward: expected a finite number"),
        (lambda e: e["body"].update(reward="1"), "reward: expected a finite number"),
        (
            lambda e: e["body"].update(sample_index=-1),
            "sample_index: expected a non-negative integer",
        ),
        (lambda e: e["body"].update(domain=3), "domain: expected a string"),
        (
            lambda e: e["body"].update(trace_context={"a": 1}),
            "trace_context: expected a map of strings",
        ),
        (lambda e: e["body"].update(timings={"a": float("inf")}), "is not finite"),
        (
            lambda e: e["body"]["policy_versions"].update(data=np.full(6, -1, "<i8").tobytes()),
            "a generated token has no version",
        ),
        (
            lambda e: e["body"]["behaviour_logprobs"].update(
                data=np.full(6, np.inf, "<f4").tobytes()
            ),
            "not finite on a generated token",
        ),
        (lambda e: e.update(body=[1, 2]), "expected a map"),
        (lambda e: e["body"].update(turn_keys=["a", 2]), "turn_keys: expected a list of strings"),
        (
            lambda e: e["body"]["turn_ids"].update(shape=[2], data=b"\0" * 8),
            "turn_ids: 2 entries for 6 tokens",
        ),
        (
            lambda e: e["body"]["turn_ids"].update(data=np.full(6, 2, "<i4").tobytes()),
            r"turn_ids: a turn id outside \[-1, 2\)",
        ),
    ],
)
def test_schema_violations_are_named(mutate, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_trajectory(_frame(mutate))


def test_oversized_frame_is_refused_before_decoding() -> None:
    frame = encode(sample())
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_trajectory(frame, max_frame_bytes=len(frame) - 1)
    assert decode_trajectory(frame, max_frame_bytes=len(frame)) == sample()


def test_a_frame_of_another_kind_is_refused() -> None:
    envelope = msgpack.unpackb(encode_map(sample()), raw=False)
    envelope["kind"] = "batch"  # a kind this schema once had
    other = msgpack.packb(envelope, use_bin_type=True)
    with pytest.raises(WireError, match="unknown frame kind 'batch'"):
        decode_trajectory(other)
    with pytest.raises(WireError, match="expected a trajectory frame"):
        peek(other)


def test_deep_nesting_and_non_bytes_input() -> None:
    deep = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(WireError):
        decode_trajectory(deep)
    with pytest.raises(WireError, match="must be bytes"):
        decode_trajectory("text")  # type: ignore[arg-type]


def test_teacher_logprobs_are_optional_and_checked() -> None:
    """A frame without teacher logprobs (one written before they existed, or of a run that
    does not distil) decodes to an empty array; one with them must match the tokens."""
    plain = sample()
    assert "teacher_logprobs" not in header(encode(plain))["body"]
    assert decode_trajectory(encode(plain)).teacher_logprobs.size == 0
    scored = sample()
    scored.teacher_logprobs = np.where(scored.loss_mask == 1, -0.5, 0).astype(np.float32)
    assert decode_trajectory(encode(scored)) == scored
    scored.teacher_logprobs = np.zeros(3, np.float32)
    with pytest.raises(WireError, match="teacher_logprobs: 3 entries for 6 tokens"):
        decode_trajectory(encode(scored))
    scored.teacher_logprobs = np.full(6, np.nan, np.float32)
    with pytest.raises(WireError, match="teacher_logprobs: not finite"):
        decode_trajectory(encode(scored))


def test_kind_travels_through_the_buffer_unchanged_and_defaults_to_tokens() -> None:
    """The buffer admits a frame on `peek` and serves its bytes as they came, so a
    trajectory of another modality reaches the trainer with its kind; a frame written
    before the field existed reads as tokens."""
    latents = sample()
    latents.kind = "latents"
    held = peek(encode(latents))
    assert held.decode() == latents and held.decode().kind == "latents"
    assert header(held.frame)["body"]["kind"] == "latents"
    old = msgpack.unpackb(encode_map(latents), raw=False)
    del old["body"]["kind"]
    assert decode_trajectory(msgpack.packb(old, use_bin_type=True)).kind == "tokens"
    assert "kind" not in header(encode(sample()))["body"]
    with pytest.raises(WireError, match="kind: expected a non-empty string"):
        decode_trajectory(_frame(lambda e: e["body"].update(kind=3)))


def test_named_tensors_travel_with_their_shapes_and_are_checked() -> None:
    """A latent trajectory's `tensors` (any shape, any wire dtype) come back as sent and
    are checked before a buffer acknowledges them; a tokens frame carries no such key."""
    latents = sample()
    latents.kind = "latents"
    latents.tensors = {
        "latents": np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32),
        "label": np.array([7], np.int64),
        "mask": np.array([[True, False]]),
    }
    back = admit(encode(latents)).decode()
    assert back == latents and back.tensors["latents"].shape == (3, 1, 8, 8)
    assert back.tensors["label"].dtype == np.int64 and back.tensors["mask"].dtype == np.bool_
    assert back.tensors["latents"].flags.writeable  # decoded arrays are the trainer's own
    assert "tensors" not in header(encode(sample()))["body"]
    for value, message in (
        ([1, 2], "tensors: expected a map"),
        ({"": {"dtype": "<f4", "shape": [0], "data": b""}}, "names must be non-empty"),
        ({"x": {"dtype": "<f4", "shape": [2, 2], "data": b"\0" * 12}}, "12 bytes of data"),
        ({"x": {"dtype": "object", "shape": [1], "data": b"\0"}}, "unsupported dtype"),
        ({str(n): {"dtype": "|u1", "shape": [0], "data": b""} for n in range(17)}, "at most 16"),
    ):
        frame = _frame(lambda e, v=value: e["body"].update(tensors=v))
        for read in (admit, decode_trajectory):
            with pytest.raises(WireError, match=message):
                read(frame)
    with pytest.raises(TypeError, match="cannot go on the wire"):
        encode(Trajectory(**{**vars(sample()), "tensors": {"x": np.array(["a"])}}))


@given(trajectories())
@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
def test_peek_reads_what_a_full_decode_reads(trajectory: Trajectory) -> None:
    frame = encode(trajectory)
    held = peek(frame)
    assert held.frame == frame and held.decode() == trajectory
    for name in ("trajectory_id", "group_id", "sample_index", "prompt_ordinal", "source"):
        assert getattr(held, name) == getattr(trajectory, name)
    generated = trajectory.policy_versions[trajectory.loss_mask == 1]
    assert held.oldest_version == (int(generated.min()) if generated.size else None)
    assert held.trace_context == trajectory.trace_context


@given(st.data())
@settings(max_examples=300)
def test_peek_of_mutated_frames_raises_wire_error_or_reads(data: st.DataObject) -> None:
    frame = mutated(data)
    try:
        held = peek(frame)
    except WireError as error:
        assert str(error)
        return
    assert isinstance(held.trajectory_id, str) and held.sample_index >= 0


def test_peek_checks_the_fields_a_relay_uses_and_leaves_the_rest_to_decode() -> None:
    broken = sample()
    broken.behaviour_logprobs[broken.loss_mask == 1] = np.nan
    frame = encode(broken)
    assert peek(frame).trajectory_id == broken.trajectory_id  # admitted on its header
    with pytest.raises(WireError, match="behaviour_logprobs: not finite"):
        decode_trajectory(frame)

    def short_versions(envelope):
        envelope["body"]["policy_versions"]["shape"] = [2]

    def wrong_mask_dtype(envelope):
        envelope["body"]["loss_mask"]["dtype"] = "<i4"

    def negative_ordinal(envelope):
        envelope["body"]["prompt_ordinal"] = -1

    for mutate, message in [
        (short_versions, "policy_versions"),
        (wrong_mask_dtype, "loss_mask"),
        (negative_ordinal, "prompt_ordinal"),
    ]:
        with pytest.raises(WireError, match=message):
            peek(_frame(mutate))
