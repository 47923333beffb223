"""The replay buffer: group assembly, deduplication, staleness, and the ZeroMQ protocol."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import zmq

from rollwire.services.buffer.client import BufferError, BufferProducer, BufferTrainerClient
from rollwire.services.buffer.protocol import PutAnswer, PutGroupAnswer
from rollwire.services.buffer.server import BufferServer
from rollwire.services.buffer.state import BufferState
from rollwire.services.core.group_frame import encode_group
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.wire import Trajectory, encode, encode_map
from tests.helpers.trajectories import trajectory


def test_groups_are_served_whole_and_in_order() -> None:
    state = BufferState(group_size=2, max_staleness=1)
    assert state.put(trajectory("a", 1)) == (True, "ok")
    assert state.take(1) is None  # group a is incomplete
    assert state.put(trajectory("b", 0)) == (True, "ok")
    assert state.put(trajectory("a", 0)) == (True, "ok")
    assert state.take(2) is None  # one complete group, two asked for
    state.put(trajectory("b", 1))
    batch = state.take(2)
    assert [t.trajectory_id for t in batch.trajectories] == ["a/0", "a/1", "b/0", "b/1"]
    assert state.ack(batch.batch_id) and not state.ack(batch.batch_id)


def test_duplicates_and_bad_indices() -> None:
    state = BufferState(group_size=2, max_staleness=1)
    assert state.put(trajectory("a", 0)) == (True, "ok")
    assert state.put(trajectory("a", 0)) == (True, "duplicate")
    assert state.accepted == 1
    assert state.put(trajectory("a", 2))[0] is False
    clash = trajectory("a", 0)
    clash.trajectory_id = "other"
    assert state.put(clash) == (False, "group 'a' already has sample 0")


def test_stale_groups_are_dropped_and_counted() -> None:
    state = BufferState(group_size=2, max_staleness=1)
    for group, version in (("old", 0), ("new", 2)):
        state.put(trajectory(group, 0, version))
        state.put(trajectory(group, 1, version))
    state.trainer_version = 3  # bound: nothing older than version 2
    batch = state.take(1)
    assert [t.group_id for t in batch.trajectories] == ["new", "new"]
    assert state.dropped == {"stale": 2}


@pytest.fixture
def buffer_server():
    state = BufferState(group_size=2, max_staleness=0)
    server = BufferServer(state)
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.integration
async def test_producer_to_trainer_over_zeromq(buffer_server) -> None:
    producer = BufferProducer(buffer_server.endpoints["producer"], timeout=2)
    trainer = BufferTrainerClient(buffer_server.endpoints["trainer"], timeout=2)
    try:
        results = [await producer.put(trajectory("g", i, reward=i)) for i in range(2)]
        assert [r.accepted for r in results] == [True, True]
        assert (await producer.put(trajectory("g", 0))).reason == "duplicate"
        batch = await asyncio.to_thread(trainer.get_batch, 0, 1, 1.0)
        assert [t.reward for t in batch.trajectories] == [0.0, 1.0]
        assert await asyncio.to_thread(trainer.get_batch, 0, 1, 0.1) is None  # waited, nothing left
        await asyncio.to_thread(trainer.ack, batch.batch_id, 1)
        status = await producer.status()
        assert status.trainer_version == 1 and status.served_trajectories == 2
        # Staleness 0: version-0 samples are now too old for trainer version 1.
        for i in range(2):
            assert (await producer.put(trajectory("late", i, version=0))).trainer_version == 1
        assert await asyncio.to_thread(trainer.get_batch, 1, 1, 0.1) is None
        assert (await producer.status()).dropped == {"stale": 2}
    finally:
        producer.close()
        trainer.close()


@pytest.mark.integration
async def test_only_the_trainer_moves_the_version_or_takes_batches() -> None:
    """With a trainer token, a client of the trainer socket without it (or with another)
    cannot raise trainer_version (which would make every group stale), take a batch or
    acknowledge one: refused, counted, and the buffer keeps serving the trainer."""
    server = BufferServer(BufferState(group_size=2, max_staleness=0), trainer_token="s3cret")
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    endpoint = server.endpoints["trainer"]
    producer = BufferProducer(server.endpoints["producer"], timeout=2)
    clients = [BufferTrainerClient(endpoint, timeout=2, token=t) for t in (None, "guess")]
    trainer = BufferTrainerClient(endpoint, timeout=2, token="s3cret")
    try:
        for i in range(2):
            assert (await producer.put(trajectory("g", i))).accepted
        before = COUNTERS.get("buffer_trainer_refused", kind="get")
        for stranger in clients:
            with pytest.raises(BufferError, match="needs the trainer's token"):
                await asyncio.to_thread(stranger.get_batch, 10**6, 1, 0.1)
            with pytest.raises(BufferError, match="needs the trainer's token"):
                await asyncio.to_thread(stranger.ack, "", 10**6, ["g/0", "g/1"])
            assert (await asyncio.to_thread(stranger.status)).trainer_version == 0
        assert COUNTERS.get("buffer_trainer_refused", kind="get") == before + 2
        batch = await asyncio.to_thread(trainer.get_batch, 0, 1, 1.0)
        assert [t.trajectory_id for t in batch.trajectories] == ["g/0", "g/1"]  # not stale
        await asyncio.to_thread(trainer.ack, batch.batch_id, 1)
        assert (await producer.status()).trainer_version == 1
    finally:
        for client in (*clients, trainer):
            client.close()
        producer.close()
        server.stop()
        thread.join(timeout=5)


@pytest.mark.integration
async def test_a_waiting_get_is_answered_when_data_arrives(buffer_server) -> None:
    producer = BufferProducer(buffer_server.endpoints["producer"], timeout=2)
    trainer = BufferTrainerClient(buffer_server.endpoints["trainer"], timeout=2)
    try:
        waiting = asyncio.ensure_future(asyncio.to_thread(trainer.get_batch, 0, 1, 5.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        for i in range(2):
            await producer.put(trajectory("late", i))
        batch = await asyncio.wait_for(waiting, 3)
        assert len(batch.trajectories) == 2
    finally:
        producer.close()
        trainer.close()


def test_the_trainer_client_answers_calls_from_several_threads_in_step(buffer_server) -> None:
    """The trainer's loop waits for a batch on one thread while a background
    checkpoint's commit runs on another: each call must get its own reply."""
    trainer = BufferTrainerClient(buffer_server.endpoints["trainer"], timeout=5)
    answers: list[object] = []

    def waits() -> None:
        for _ in range(3):
            answers.append(trainer.get_batch(0, 1, 0.2))  # nothing there: None each time

    def commits() -> None:
        for _ in range(20):
            answers.append(trainer.commit(["never-served"]))

    try:
        threads = [threading.Thread(target=waits), threading.Thread(target=commits)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert sorted(map(repr, answers)) == sorted(["None"] * 3 + ["0"] * 20)
    finally:
        trainer.close()


@pytest.mark.integration
def test_garbage_gets_an_answer_and_the_buffer_keeps_serving(buffer_server) -> None:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 2000)
    socket.connect(buffer_server.endpoints["producer"])
    try:
        socket.send_multipart([b"hello"])
        assert socket.recv_multipart()[0] == b"error"
        socket.send_multipart([b"put", b"\0" * 8, b"\x93not a frame"])
        kind, seq, body = socket.recv_multipart()
        assert seq == b"\0" * 8
        reply = PutAnswer.decode(body)
        assert kind == b"ack" and reply.accepted is False and reply.reason.startswith("bad frame")
        trainer = zmq.Context.instance().socket(zmq.DEALER)
        trainer.setsockopt(zmq.LINGER, 0)
        trainer.setsockopt(zmq.RCVTIMEO, 2000)
        trainer.connect(buffer_server.endpoints["trainer"])
        trainer.send_multipart([b"get", b"{not json"])
        assert trainer.recv_multipart()[0] == b"error"
        trainer.send_multipart([b"status"])
        assert trainer.recv_multipart()[0] == b"status"
        trainer.close(0)
    finally:
        socket.close(0)


@pytest.mark.integration
def test_a_group_comes_as_one_frame_or_as_one_part_a_trajectory(buffer_server) -> None:
    """put_group takes a group frame (what BufferProducer sends) or the trajectories as
    parts (a producer written in another language, in the first layout); a group frame
    that does not split is refused in one answer, counted, and the buffer keeps serving."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 2000)
    socket.connect(buffer_server.endpoints["producer"])
    try:
        parts = [encode_map(trajectory("parts", i)) for i in range(2)]
        socket.send_multipart([b"put_group", b"\0" * 7 + b"\1", *parts])
        kind, _, body = socket.recv_multipart()
        assert [a.reason for a in PutGroupAnswer.decode(body).answers()] == ["ok", "ok"]
        before = COUNTERS.get("buffer_bad_frames")
        broken = encode_group([encode(trajectory("split", i)) for i in range(2)])[:-1]
        socket.send_multipart([b"put_group", b"\0" * 7 + b"\2", broken])
        kind, seq, body = socket.recv_multipart()
        (answer,) = PutGroupAnswer.decode(body).answers()
        assert kind == b"ack" and seq == b"\0" * 7 + b"\2" and not answer.accepted
        assert answer.reason.startswith("bad frame: ") and "run past" in answer.reason
        assert COUNTERS.get("buffer_bad_frames") == before + 1
        whole = encode_group([encode(trajectory("split", i)) for i in range(2)])
        socket.send_multipart([b"put_group", b"\0" * 7 + b"\3", whole])
        kind, _, body = socket.recv_multipart()
        assert [a.reason for a in PutGroupAnswer.decode(body).answers()] == ["ok", "ok"]
        socket.send_multipart([b"status"])
        assert b'"ready_groups": 2' in socket.recv_multipart()[1]
    finally:
        socket.close(0)


@pytest.mark.integration
async def test_a_group_over_the_frame_limit_is_refused_for_each_of_its_trajectories() -> None:
    frame_bytes = len(encode(trajectory("big", 0)))
    server = BufferServer(BufferState(group_size=2, max_staleness=0), max_frame_bytes=frame_bytes)
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    producer = BufferProducer(server.endpoints["producer"], timeout=2, attempts=1)
    try:
        big = trajectory("big", 1)
        big.token_ids = np.concatenate([big.token_ids, big.token_ids])
        answers = await producer.put_group([trajectory("big", 0), big])
        assert len(answers) == 2 and not any(a.accepted or a.wait_and_retry for a in answers)
        assert "group member 1" in answers[1].reason and "exceed the limit" in answers[1].reason
        assert [a.reason for a in await producer.put_group([trajectory("fits", 0)])] == ["ok"]
    finally:
        producer.close()
        server.stop()
        thread.join(timeout=5)


async def test_producer_gives_up_with_a_clear_error_when_nobody_answers() -> None:
    producer = BufferProducer("tcp://127.0.0.1:1", timeout=0.1, attempts=2)
    try:
        with pytest.raises(BufferError, match=r"did not answer 2 tries of 0.1s"):
            await producer.put(trajectory("g", 0))
    finally:
        producer.close()


async def test_an_unanswered_put_is_sent_again_with_its_seq_and_the_resend_counted() -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 3000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[tuple[bytes, bytes]] = []

    def buffer_that_misses_the_first_put() -> None:
        router.recv_multipart()  # lost: never answered
        identity, kind, seq, _ = router.recv_multipart()
        seen.append((kind, seq))
        stale = (int.from_bytes(seq, "big") - 1).to_bytes(8, "big")
        router.send_multipart([identity, b"ack", stale, PutAnswer(False, "old").encode()])
        router.send_multipart([identity, b"ack", seq, PutAnswer(True, "ok", 4).encode()])

    before = COUNTERS.get("buffer_resends")
    fake = threading.Thread(target=buffer_that_misses_the_first_put, daemon=True)
    fake.start()
    producer = BufferProducer(f"tcp://127.0.0.1:{port}", timeout=1.0, attempts=3)
    try:
        answer = await producer.put(trajectory("g", 0))
        # The answer echoing another seq (an earlier request's) is passed over.
        assert (answer.accepted, answer.reason, answer.trainer_version) == (True, "ok", 4)
        assert seen == [(b"put", (1).to_bytes(8, "big"))]  # the same seq, sent again
        assert COUNTERS.get("buffer_resends") == before + 1
    finally:
        producer.close()
        fake.join(timeout=5)
        router.close(0)


def _undecodable(group: str, index: int, version: int = 0) -> Trajectory:
    """A sample whose header fields are fine but whose logprob on a generated token is
    NaN: what `peek` alone would let through and the trainer's full decode refuses."""
    broken = trajectory(group, index, version)
    broken.behaviour_logprobs[2] = np.nan
    return broken


@pytest.mark.integration
async def test_a_frame_broken_past_its_header_is_refused_in_its_ack(buffer_server) -> None:
    """The buffer checks every frame in full before acknowledging it: a broken one is
    refused to its producer (counted), never stored to cost the trainer its group; and
    what it serves is the bytes it was sent."""

    producer = BufferProducer(buffer_server.endpoints["producer"], timeout=2)
    trainer = BufferTrainerClient(buffer_server.endpoints["trainer"], timeout=2)
    try:
        sent = [trajectory("whole", i, reward=i) for i in range(2)]
        assert all(a.accepted for a in await producer.put_group(sent))
        served = await asyncio.to_thread(trainer.get_frames, 0, 1, 1.0)
        assert served is not None
        header, frames = served
        assert header.trajectories == 2 and frames == [encode(t) for t in sent]  # byte for byte
        await asyncio.to_thread(trainer.ack, header.batch_id, 0)

        before = COUNTERS.get("buffer_bad_frames")
        answers = await producer.put_group([_undecodable("bad", 0), trajectory("bad", 1)])
        assert not answers[0].accepted and not answers[0].wait_and_retry  # final
        assert answers[0].reason.startswith("bad frame: ")
        assert "behaviour_logprobs: not finite" in answers[0].reason
        assert answers[1].reason == "ok"
        assert COUNTERS.get("buffer_bad_frames") == before + 1
        status = await producer.status()
        assert status.accepted == 3 and status.partial_groups == 1 and status.ready_groups == 0
    finally:
        producer.close()
        trainer.close()


@pytest.mark.integration
async def test_a_bad_frame_already_held_costs_its_group_only() -> None:
    """Frames held before the buffer checked them in full (a log written by an older
    buffer) are still caught by the trainer's client: their groups are let go
    ("bad_frame"), the rest is trained, and a batch of bad groups only is acknowledged
    by the client itself."""
    from rollwire.services.core.wire import peek

    state = BufferState(group_size=2, max_staleness=5)
    held = [trajectory("good", 0), _undecodable("bad", 0), trajectory("bad", 1)]
    held += [trajectory("good", 1), *(_undecodable("worse", i, version=1) for i in range(2))]
    for sample in held:
        assert state.put(peek(encode(sample))) == (True, "ok")
    server = BufferServer(state)
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    trainer = BufferTrainerClient(server.endpoints["trainer"], timeout=2)
    try:
        before = COUNTERS.get("buffer_bad_frames_served")
        batch = await asyncio.to_thread(trainer.get_batch, 0, 2, 1.0)
        assert [t.trajectory_id for t in batch.trajectories] == ["good/0", "good/1"]
        assert COUNTERS.get("buffer_bad_frames_served") == before + 2
        await asyncio.to_thread(trainer.ack, batch.batch_id, 1)
        status = await asyncio.to_thread(trainer.status)
        assert status.dropped == {"bad_frame": 2}
        assert status.outcomes == {"trained": 1, "bad_frame": 1}
        assert await asyncio.to_thread(trainer.get_batch, 1, 1, 1.0) is None  # "worse" only
        assert (await asyncio.to_thread(trainer.status)).outcomes["bad_frame"] == 2
    finally:
        trainer.close()
        server.stop()
        thread.join(timeout=5)


@pytest.mark.integration
async def test_one_producer_has_many_puts_in_flight_and_each_gets_its_own_answer(
    buffer_server,
) -> None:
    producer = BufferProducer(buffer_server.endpoints["producer"], timeout=2, attempts=1)
    try:
        puts = [producer.put(trajectory(f"many{g}", i)) for g in range(20) for i in range(2)]
        answers = await asyncio.gather(*puts, producer.status(), producer.ledger())
        acks, status = answers[:-2], answers[-2]
        assert [a.reason for a in acks] == ["ok"] * 40
        assert status.accepted <= 40  # answered while the puts were in flight
        again = await asyncio.gather(*(producer.put(trajectory("many3", i)) for i in range(2)))
        assert [a.reason for a in again] == ["duplicate", "duplicate"]
        assert (await producer.status()).ready_groups == 20
    finally:
        producer.close()


@pytest.mark.integration
async def test_a_put_the_buffer_fails_on_is_refused_in_its_own_ack(buffer_server, monkeypatch):
    def broken_check(trajectory):
        raise RuntimeError("a bug")

    monkeypatch.setattr(buffer_server.state, "check", broken_check)
    producer = BufferProducer(buffer_server.endpoints["producer"], timeout=2, attempts=1)
    try:
        single, group = await asyncio.gather(
            producer.put(trajectory("x", 0)), producer.put_group([trajectory("y", 0)])
        )
        assert not single.accepted and single.reason == "internal error: RuntimeError: a bug"
        assert [a.reason for a in group] == ["internal error: RuntimeError: a bug"]
        monkeypatch.undo()
        assert (await producer.put(trajectory("x", 0))).accepted  # and it keeps serving
    finally:
        producer.close()
