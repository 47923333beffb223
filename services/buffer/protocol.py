"""The buffer's messages, typed: every request and reply on its two ROUTER sockets.

Frames (ZeroMQ multipart; a DEALER sends them, the ROUTER adds the identity):

producer socket (orchestrators)
    [b"put", seq, frame]            -> [b"ack", seq, PutAnswer]
    [b"put_group", seq, group]      -> [b"ack", seq, PutGroupAnswer]
    [b"put_group", seq, frame, ...] -> [b"ack", seq, PutGroupAnswer]
    [b"drop", seq, DropRequest]     -> [b"ack", seq, PutAnswer]
    [b"ledger"]                     -> [b"ledger", LedgerView]
    [b"status"]                     -> [b"status", BufferStatus]
trainer socket (one trainer)
    [b"get", GetRequest, token]         -> [b"batch", BatchHeader, frame, ...] or [b"empty", BufferStatus]
    [b"ack", AckRequest, token]         -> [b"acked", AckAnswer]
    [b"commit", CommitRequest, token]   -> [b"committed", CommitAnswer]
    [b"resume", ResumeRequest, token]   -> [b"resumed", ResumeAnswer]
    [b"status"]                         -> [b"status", BufferStatus]
    `token` is the trainer's secret (`buffer.trainer_token_file`); a buffer with one
    answers a request without it [b"error", ...]. Without one the frame may be left out.
either socket, on a request it cannot take
    [b"error", UTF-8 text saying what was wrong]

`seq` is the producer's 8-byte big-endian sequence number, echoed in the answer;
`frame` is a wire-encoded Trajectory (`rollwire.services.core.wire`), in either of its
layouts; `group` is a group frame (`group_frame.encode_group`: several frames in one, what
`BufferProducer.put_group` sends), answered one result per member, or with a single
refusal when the group frame itself does not split ("bad frame: ..."). Every other
body is one of the records below as a UTF-8 JSON object. A producer may have
several requests with a seq in flight at once; their answers may come in any order.

The buffer checks a put's frame in full (`wire.admit`) before acknowledging it,
refusing a broken one ("bad frame: ..."), and serves the frames as they came. The
trainer decodes them again; a frame that fails there (held from a log an older
buffer wrote) is reported in the batch's ack (`bad_ids`) and its group is let go
with the outcome "bad_frame", never trained on.

Delivery guarantees (what callers may rely on):

- A put is answered only once the trajectory is in memory and in the buffer's
  log on disk; an unanswered put may be sent again with the same seq and
  trajectory id, and the buffer keeps one copy (the answer says "duplicate").
- A refused put says why: "full" and reasons starting "storage:" mean wait and
  send again; anything else ("stale", "bad frame: ...") is final.
- A batch is served to the trainer until it is acknowledged; an ack, commit or
  resume is answered once what it changed is on disk, and sending it again
  changes nothing twice.
- Every record decodes strictly: a missing or mistyped field is a
  `ProtocolError` with the field's name, which the buffer answers as
  [b"error", ...] and counts, and keeps serving. A drop is the exception: it
  carries a seq, so a malformed one is answered [b"ack", seq, PutAnswer] refused
  with a reason starting "bad drop:" (final, like any other refusal).
- An optional field may be left out or sent as null; both mean "not told".
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, Self, get_type_hints

PUT, PUT_GROUP, DROP, LEDGER, STATUS = b"put", b"put_group", b"drop", b"ledger", b"status"
GET, ACK, COMMIT, RESUME = b"get", b"ack", b"commit", b"resume"
BATCH, EMPTY, ACKED, COMMITTED, RESUMED, ERROR = (
    b"batch",
    b"empty",
    b"acked",
    b"committed",
    b"resumed",
    b"error",
)


class ProtocolError(ValueError):
    """A body that is not the record it should be; the message names the field."""


@dataclass(frozen=True)
class Record:
    """A JSON object with typed fields; unknown keys are ignored (newer peers may add some)."""

    def encode(self) -> bytes:
        """The record as a JSON object; optional fields that are None are left out."""
        # Fields hold JSON values only (no nested records), so no deep copy is needed.
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({k: v for k, v in values.items() if v is not None}).encode()

    @classmethod
    def decode(cls, body: bytes) -> Self:
        """The record in `body` (empty: an empty object), or ProtocolError."""
        try:
            data = json.loads(bytes(body) if isinstance(body, memoryview) else body) if body else {}
        except ValueError as error:
            raise ProtocolError(f"bad JSON body: {error}") from None
        if not isinstance(data, dict):
            raise ProtocolError("body is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The record from a decoded JSON object, or ProtocolError naming the field."""
        hints = _hints(cls)
        values = {}
        for item in fields(cls):
            if item.name in data:
                values[item.name] = _check(
                    cls.__name__, item.name, hints[item.name], data[item.name]
                )
            elif item.default is MISSING and item.default_factory is MISSING:
                raise ProtocolError(f"{cls.__name__}.{item.name} is missing")
        record = cls(**values)
        record.validate()
        return record

    def validate(self) -> None:
        """Raises ProtocolError if the values break a rule beyond their types. Run on
        decoding only: the side that receives a request is the one to judge it."""


@cache
def _hints(record: type) -> dict[str, Any]:
    # Resolving the annotations is slow next to decoding a small body: once per record.
    return get_type_hints(record)


def _check(record: str, name: str, hint: Any, value: Any) -> Any:
    """`value` as the field's type, or ProtocolError."""
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    if value is None and "None" in text:
        return None
    try:
        if text.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
            return value
        if text.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError
            return float(value)
        if text.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if text.startswith("str"):
            if not isinstance(value, str):
                raise TypeError
            return value
        if text.startswith("list[str]"):
            if not isinstance(value, list):
                raise TypeError
            return [str(v) for v in value]
        if text.startswith("list[int]"):
            if not isinstance(value, list):
                raise TypeError
            return [int(v) for v in value]
        if text.startswith("list[dict"):
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise TypeError
            return value
        if text.startswith("dict[str, int]"):
            if not isinstance(value, dict):
                raise TypeError
            return {str(k): int(v) for k, v in value.items()}
        if text.startswith("dict[str, list[int]]"):
            if not isinstance(value, dict):
                raise TypeError
            return {str(k): [int(i) for i in v] for k, v in value.items()}
    except (TypeError, ValueError):
        raise ProtocolError(
            f"{record}.{name} must be {text.replace(' | None', '')}, not {value!r:.60}"
        ) from None
    raise AssertionError(f"{record}.{name}: no check for {text}")


# The producer's side.


@dataclass(frozen=True)
class PutAnswer(Record):
    """The answer to one put (or to a drop)."""

    accepted: bool
    reason: str
    """"ok", "duplicate", or why it was refused ("full", "storage: ...", "stale", ...)."""
    trainer_version: int = 0
    trainer_step: int = 0

    @property
    def wait_and_retry(self) -> bool:
        """Refused for now only: the buffer is full or cannot write its log."""
        return not self.accepted and (self.reason == "full" or self.reason.startswith("storage:"))


@dataclass(frozen=True)
class PutGroupAnswer(Record):
    """One answer per trajectory of a put_group, in order."""

    results: list[dict[str, Any]]
    trainer_version: int = 0

    def answers(self) -> list[PutAnswer]:
        """The results as PutAnswers, in order; ProtocolError if one is malformed."""
        return [
            PutAnswer(
                _check("PutGroupAnswer", f"results[{i}].accepted", bool, r.get("accepted")),
                _check("PutGroupAnswer", f"results[{i}].reason", str, r.get("reason")),
                self.trainer_version,
            )
            for i, r in enumerate(self.results)
        ]


@dataclass(frozen=True)
class DropRequest(Record):
    """The producer gave up on a prompt: its ordinal ends with `outcome`."""

    ordinal: int
    group_id: str
    outcome: str
    """"filtered", "failed", ..."""

    def validate(self) -> None:
        if self.ordinal < 0:
            raise ProtocolError(f"DropRequest.ordinal must be >= 0, not {self.ordinal}")
        if not self.outcome:
            raise ProtocolError("DropRequest.outcome must not be empty")


@dataclass(frozen=True)
class LedgerView(Record):
    """The ordinal ledger (see `ledger.OrdinalLedger`) and what the buffer holds now."""

    frontier: int
    """Every ordinal below this is finished."""
    above: list[int]
    """Finished ordinals at or above the frontier."""
    highest: int
    """The highest ordinal seen at all."""
    outcomes: dict[str, int]
    """Groups finished, by outcome."""
    whole: list[int] = field(default_factory=list)
    """Ordinals of whole groups held (ready, served, or trained but not checkpointed)."""
    partial: dict[str, list[int]] = field(default_factory=dict)
    """Ordinal (as text) -> sample indices held, for groups only part of which arrived."""


@dataclass(frozen=True)
class BufferStatus(Record):
    """What the buffer holds and has done; the answer to status, and to a get that
    found nothing within its wait."""

    trainer_version: int = 0
    trainer_step: int = 0
    accepted: int = 0
    ready_groups: int = 0
    partial_groups: int = 0
    served_trajectories: int = 0
    unacked_batches: int = 0
    trained_uncommitted_batches: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Trajectories dropped, by reason."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Groups finished, by outcome (the ledger's)."""
    frontier: int = 0


# The trainer's side.


@dataclass(frozen=True)
class GetRequest(Record):
    """Ask for `groups` whole groups, waiting up to `wait_ms` for them."""

    trainer_version: int | None = None
    groups: int = 1
    wait_ms: float = 0
    trainer_step: int | None = None

    def validate(self) -> None:
        if self.groups < 1:
            raise ProtocolError(f"GetRequest.groups must be at least 1, not {self.groups}")
        if not math.isfinite(self.wait_ms):  # JSON as Python reads it allows Infinity, NaN
            raise ProtocolError(f"GetRequest.wait_ms must be finite, not {self.wait_ms}")


@dataclass(frozen=True)
class AckRequest(Record):
    """A served batch was trained. With `commit` false it is kept until a commit."""

    batch_id: str = ""
    """Empty, or a batch this buffer does not know: found by `trajectory_ids` instead."""
    trainer_version: int | None = None
    commit: bool = True
    trajectory_ids: list[str] | None = None
    """The batch's trajectories: a buffer restarted since serving it still finds them."""
    trainer_step: int | None = None
    bad_ids: list[str] | None = None
    """Trajectories of the batch the trainer could not decode: their groups were not
    trained and are let go with the outcome "bad_frame"."""


@dataclass(frozen=True)
class BatchHeader(Record):
    """The first part of a batch reply; the trajectories' frames follow, one part each."""

    batch_id: str
    trainer_version: int
    trajectories: int

    def validate(self) -> None:
        if self.trajectories < 0:
            raise ProtocolError("BatchHeader.trajectories must be >= 0")


@dataclass(frozen=True)
class AckAnswer(Record):
    known: bool
    """False: the buffer knew neither the batch nor its trajectories."""
    trainer_version: int = 0


@dataclass(frozen=True)
class CommitRequest(Record):
    """A trainer checkpoint now holds these trajectories: let them go."""

    trajectory_ids: list[str] = field(default_factory=list)
    trainer_version: int | None = None
    trainer_step: int | None = None


@dataclass(frozen=True)
class CommitAnswer(Record):
    groups: int
    """Groups committed."""
    trainer_version: int = 0


@dataclass(frozen=True)
class ResumeRequest(Record):
    """A trainer restarted from a checkpoint holding `committed_ids`."""

    committed_ids: list[str] = field(default_factory=list)
    trainer_version: int | None = None
    trainer_step: int | None = None
    """The checkpoint's step: the buffer's step goes back to it."""


@dataclass(frozen=True)
class ResumeAnswer(Record):
    committed_groups: int
    requeued_groups: int
    """Groups served or trained after the checkpoint, to be served again."""
    trainer_version: int = 0
