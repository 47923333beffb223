"""The buffer's typed messages: each record round-trips, keeps the JSON keys peers in
other languages rely on, and a body that is not the record is a ProtocolError that
names the field; over the socket such a body is answered, counted, and the buffer
goes on serving."""

from __future__ import annotations

import json

import pytest
import zmq

from rollwire.services.buffer.protocol import (
    AckAnswer,
    AckRequest,
    BufferStatus,
    CommitAnswer,
    CommitRequest,
    DropRequest,
    GetRequest,
    LedgerView,
    ProtocolError,
    PutAnswer,
    PutGroupAnswer,
    Record,
    ResumeAnswer,
    ResumeRequest,
)
from rollwire.services.core.metrics import COUNTERS
from tests.helpers.servers import Running

EXAMPLES: list[Record] = [
    PutAnswer(True, "ok", 3, 7),
    PutAnswer(False, "storage: disk full"),
    PutGroupAnswer([{"accepted": True, "reason": "ok"}, {"accepted": False, "reason": "stale"}], 2),
    DropRequest(4, "run/g4", "filtered"),
    LedgerView(2, [4, 6], 9, {"trained": 2}, [7, 8], {"9": [0, 2]}),
    BufferStatus(1, 5, 10, 2, 1, 8, 1, 0, {"stale": 2}, {"trained": 3}, 3),
    GetRequest(4, groups=2, wait_ms=500, trainer_step=9),
    GetRequest(),
    AckRequest("b1", 4, commit=False, trajectory_ids=["a/0", "a/1"], trainer_step=9),
    AckAnswer(True, 4),
    CommitRequest(["a/0"], trainer_version=4, trainer_step=9),
    CommitAnswer(1, 4),
    ResumeRequest(["a/0"], 4, 9),
    ResumeAnswer(1, 2, 4),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips(record: Record) -> None:
    assert type(record).decode(record.encode()) == record


# The keys each message carried before the records existed; peers still read them.
WIRE_KEYS: list[tuple[Record, list[str]]] = [
    (PutAnswer(True, "ok"), ["accepted", "reason", "trainer_version", "trainer_step"]),
    (PutGroupAnswer([{"accepted": True, "reason": "ok"}]), ["results", "trainer_version"]),
    (
        LedgerView(0, [], -1, {}),
        ["frontier", "above", "highest", "outcomes", "whole", "partial"],
    ),
    (
        BufferStatus(),
        [
            *("trainer_version", "trainer_step", "accepted", "ready_groups", "partial_groups"),
            *("served_trajectories", "unacked_batches", "trained_uncommitted_batches"),
            *("dropped", "outcomes", "frontier"),
        ],
    ),
    (AckAnswer(True), ["known", "trainer_version"]),
    (CommitAnswer(0), ["groups", "trainer_version"]),
    (ResumeAnswer(0, 0), ["committed_groups", "requeued_groups", "trainer_version"]),
    # Requests leave out what the caller did not say, as the clients always did.
    (GetRequest(0, 1, 0), ["trainer_version", "groups", "wait_ms"]),
    (AckRequest("b", 0), ["batch_id", "trainer_version", "commit"]),
    (CommitRequest(["a/0"]), ["trajectory_ids"]),
    (ResumeRequest([], 0, 0), ["committed_ids", "trainer_version", "trainer_step"]),
    (DropRequest(0, "g", "failed"), ["ordinal", "group_id", "outcome"]),
]


@pytest.mark.parametrize(
    ("record", "keys"), WIRE_KEYS, ids=[type(r).__name__ for r, _ in WIRE_KEYS]
)
def test_the_json_keys_on_the_wire_stay_what_they_were(record: Record, keys: list[str]) -> None:
    assert list(json.loads(record.encode())) == keys


@pytest.mark.parametrize(
    ("record", "body", "field"),
    [
        (PutAnswer, {"reason": "ok"}, "accepted"),
        (PutAnswer, {"accepted": 1, "reason": "ok"}, "accepted"),
        (PutAnswer, {"accepted": True, "reason": None}, "reason"),
        (PutGroupAnswer, {"results": {"accepted": True}}, "results"),
        (DropRequest, {"ordinal": 1, "outcome": "failed"}, "group_id"),
        (DropRequest, {"ordinal": "1", "group_id": "g", "outcome": "failed"}, "ordinal"),
        (DropRequest, {"ordinal": -1, "group_id": "g", "outcome": "failed"}, "ordinal"),
        (DropRequest, {"ordinal": 1, "group_id": "g", "outcome": ""}, "outcome"),
        (LedgerView, {"above": [], "highest": 0, "outcomes": {}}, "frontier"),
        (LedgerView, {"frontier": 0, "above": [], "highest": 0, "outcomes": []}, "outcomes"),
        (
            LedgerView,
            {"frontier": 0, "above": [], "highest": 0, "outcomes": {}, "partial": {"3": "x"}},
            "partial",
        ),
        (BufferStatus, {"dropped": ["stale"]}, "dropped"),
        (BufferStatus, {"trainer_version": 1.5}, "trainer_version"),
        (GetRequest, {"groups": True}, "groups"),
        (GetRequest, {"groups": "2"}, "groups"),
        (GetRequest, {"groups": 0}, "groups"),
        (GetRequest, {"wait_ms": "soon"}, "wait_ms"),
        (GetRequest, {"wait_ms": float("nan")}, "wait_ms"),
        (AckRequest, {"batch_id": 5}, "batch_id"),
        (AckRequest, {"batch_id": "b", "commit": "yes"}, "commit"),
        (AckRequest, {"batch_id": "b", "trajectory_ids": "a/0"}, "trajectory_ids"),
        (AckAnswer, {"trainer_version": 1}, "known"),
        (CommitRequest, {"trajectory_ids": None}, "trajectory_ids"),
        (CommitAnswer, {"groups": "1"}, "groups"),
        (ResumeRequest, {"committed_ids": [], "trainer_step": "3"}, "trainer_step"),
        (ResumeAnswer, {"committed_groups": 0}, "requeued_groups"),
    ],
)
def test_a_missing_or_mistyped_field_is_an_error_naming_it(
    record: type[Record], body: dict, field: str
) -> None:
    with pytest.raises(ProtocolError, match=rf"{record.__name__}\.{field}\b"):
        record.decode(json.dumps(body).encode())


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_a_body_that_is_no_json_object_is_an_error(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="JSON"):
        AckRequest.decode(body)


def test_what_the_buffer_always_took_without_a_field_still_decodes() -> None:
    # Older trainers left these out; the buffer used the same defaults then.
    assert GetRequest.decode(b"") == GetRequest(None, 1, 0, None)
    assert AckRequest.decode(b'{"trajectory_ids": ["a/0"]}') == AckRequest("", None, True, ["a/0"])
    assert CommitRequest.decode(b"{}") == CommitRequest([])
    assert ResumeRequest.decode(b'{"trainer_step": null}') == ResumeRequest([], None, None)
    # Keys a newer peer adds are ignored.
    assert CommitAnswer.decode(b'{"groups": 2, "later": "x"}') == CommitAnswer(2)


def test_a_group_answer_reads_as_one_put_answer_per_trajectory() -> None:
    answer = PutGroupAnswer.decode(
        b'{"results": [{"accepted": true, "reason": "ok"}, {"accepted": false, "reason": "full"}],'
        b' "trainer_version": 3}'
    )
    assert answer.answers() == [PutAnswer(True, "ok", 3), PutAnswer(False, "full", 3)]
    assert [a.wait_and_retry for a in answer.answers()] == [False, True]
    assert PutAnswer(False, "storage: gone").wait_and_retry
    assert not PutAnswer(False, "stale").wait_and_retry
    broken = PutGroupAnswer([{"accepted": True, "reason": "ok"}, {"reason": "ok"}])
    with pytest.raises(ProtocolError, match=r"results\[1\]\.accepted"):
        broken.answers()


@pytest.mark.integration
def test_the_buffer_answers_a_mistyped_request_and_keeps_serving(tmp_path) -> None:
    running = Running(tmp_path)
    context = zmq.Context.instance()
    trainer, producer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    for socket, name in ((trainer, "trainer"), (producer, "producer")):
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, 2000)
        socket.connect(running.server.endpoints[name])
    bad_trainer = COUNTERS.get("buffer_bad_messages", socket="trainer")
    bad_producer = COUNTERS.get("buffer_bad_messages", socket="producer")
    try:
        trainer.send_multipart([b"ack", b'{"batch_id": 5}'])
        kind, text = trainer.recv_multipart()
        assert kind == b"error" and b"AckRequest.batch_id" in text
        assert COUNTERS.get("buffer_bad_messages", socket="trainer") == bad_trainer + 1
        # A drop carries a seq: it is refused in its ack, which names the field too.
        seq = (9).to_bytes(8, "big")
        producer.send_multipart([b"drop", seq, b'{"ordinal": 1, "outcome": "failed"}'])
        kind, echoed, body = producer.recv_multipart()
        refused = PutAnswer.decode(body)
        assert (kind, echoed, refused.accepted) == (b"ack", seq, False)
        assert refused.reason == "bad drop: DropRequest.group_id is missing"
        assert COUNTERS.get("buffer_bad_messages", socket="producer") == bad_producer + 1
        trainer.send_multipart([b"status"])
        kind, body = trainer.recv_multipart()
        assert kind == b"status" and BufferStatus.decode(body).accepted == 0
    finally:
        trainer.close(0)
        producer.close(0)
        running.stop()
