"""The ordinal ledger and the trainer's checkpoint protocol (trained -> committed,
or requeued on resume), in memory and across buffer restarts."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.services.buffer.ledger import OrdinalLedger
from rollwire.services.buffer.protocol import ResumeAnswer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from tests.helpers.servers import Running
from tests.helpers.trajectories import trajectory


def fill(state: BufferState, *groups: str, ordinals: list[int] | None = None) -> None:
    for n, group in enumerate(groups):
        for index in range(state.group_size):
            ordinal = None if ordinals is None else ordinals[n]
            assert state.put(trajectory(group, index, ordinal=ordinal))[0]


def test_the_ledger_keeps_a_frontier_and_the_finished_above_it() -> None:
    ledger = OrdinalLedger()
    assert ledger.finish(1, "trained") and ledger.finish(3, "stale")
    assert (ledger.frontier, ledger.above) == (0, {1, 3})
    assert ledger.finish(0, "filtered") and not ledger.finish(1, "trained")
    assert (ledger.frontier, ledger.above, ledger.highest) == (2, {3}, 3)
    ledger.saw(7)
    assert ledger.gaps(held={5}) == [2, 4, 6, 7]
    assert ledger.outcomes == {"trained": 1, "stale": 1, "filtered": 1}
    assert OrdinalLedger.from_snapshot(ledger.snapshot()) == ledger


def test_trained_groups_wait_for_the_commit_and_come_back_on_resume() -> None:
    state = BufferState(group_size=2, max_staleness=5)
    fill(state, "a", "b", "c", ordinals=[0, 1, 2])
    first, second = state.take(1), state.take(1)
    assert state.ack(first.batch_id, commit=False) and state.ack(second.batch_id, commit=False)
    assert state.take(2) is None and len(state.trained) == 2  # not served again meanwhile
    assert state.commit([t.trajectory_id for t in first.trajectories]) == 1
    assert state.ledger.frontier == 1 and state.ledger.outcomes == {"trained": 1}
    # The trainer died after its checkpoint of `first`; it had trained `second` too.
    resumed = state.resume([t.trajectory_id for t in first.trajectories])
    assert (resumed.committed_groups, resumed.requeued_groups) == (0, 1)
    again = state.take(2)
    assert [t.group_id for t in again.trajectories] == ["b", "b", "c", "c"]
    # What a finished ordinal sends again is a duplicate, kept nowhere.
    assert state.put(trajectory("a", 0, ordinal=0)) == (True, "duplicate")
    assert state.take(1) is None


def test_a_dropped_ordinal_lets_its_partial_group_go() -> None:
    state = BufferState(group_size=2, max_staleness=5)
    state.put(trajectory("f", 0, ordinal=4))
    assert state.drop_ordinal(4, "f", "failed") and not state.drop_ordinal(4, "f", "failed")
    assert not state.partial and state.ledger.above == {4}
    assert state.put(trajectory("f", 1, ordinal=4)) == (True, "duplicate")
    held = state.ledger_view()
    assert (held.whole, held.partial) == ([], {})
    kinds = [kind for kind, _ in state.take_journal()]
    assert kinds == [b"C"]


def test_one_group_cannot_mix_prompt_ordinals() -> None:
    state = BufferState(group_size=2, max_staleness=5)
    state.put(trajectory("m", 0, ordinal=1))
    accepted, reason = state.put(trajectory("m", 1, ordinal=2))
    assert not accepted and "prompt_ordinal 1, not 2" in reason


def test_the_log_keeps_trained_groups_out_of_service_and_the_ledger_past_deletion(
    tmp_path,
) -> None:
    def reopen() -> tuple[BufferState, TrajectoryLog]:
        state = BufferState(group_size=2, max_staleness=5)
        trajectory_log = TrajectoryLog(tmp_path, segment_bytes=4096)
        trajectory_log.restore(state, 1 << 20)
        state.requeue_unacked()
        return state, trajectory_log

    from rollwire.services.core.wire import TrajectoryFrame

    state, trajectory_log = reopen()
    names = [f"g{n}" for n in range(12)]
    for n, name in enumerate(names):
        for index in range(2):
            t = TrajectoryFrame.of(trajectory(name, index, ordinal=n))
            assert state.check(t) == (True, "ok")
            trajectory_log.append_trajectory(t.trajectory_id, t.frame)
            state.add(t)
    batches = [state.take(2) for _ in range(5)]  # ten groups served
    for batch in batches:
        assert state.ack(batch.batch_id, commit=False)
    for batch in batches[:4]:  # a checkpoint holds eight of them
        state.commit([t.trajectory_id for t in batch.trajectories])
    trajectory_log.write(state.take_journal(), state.ledger)
    trajectory_log.flush()
    assert trajectory_log.log.first_offset > 0, "consumed segments were not deleted"
    trajectory_log.close()

    state, trajectory_log = reopen()
    try:
        assert state.ledger.frontier == 8 and state.ledger.outcomes == {"trained": 8}
        assert [g[0].group_id for g in state.trained["restored"]] == ["g8", "g9"]
        assert [g[0].group_id for g in state.ready] == ["g10", "g11"]
        # Ordinals whose records were deleted still count as done.
        assert state.put(trajectory("g0", 0, ordinal=0)) == (True, "duplicate")
        resumed = state.resume([])
        assert (resumed.committed_groups, resumed.requeued_groups) == (0, 2)
        assert [g[0].group_id for g in state.ready] == ["g8", "g9", "g10", "g11"]
    finally:
        trajectory_log.close()


@pytest.mark.integration
async def test_commit_resume_drop_and_ledger_over_zeromq(tmp_path) -> None:
    first = Running(tmp_path)
    try:
        for group, ordinal in (("a", 0), ("b", 1), ("c", 2)):
            for i in range(2):
                assert (await first.producer.put(trajectory(group, i, ordinal=ordinal))).accepted
        await first.producer.put(trajectory("d", 0, ordinal=3))  # half a group
        assert (await first.producer.drop(5, "e", "filtered")).reason == "ok"
        for _ in range(2):
            batch = await asyncio.to_thread(first.trainer.get_batch, 0, 1, 1.0, 0)
            await asyncio.to_thread(
                first.trainer.ack,
                batch.batch_id,
                1,
                [t.trajectory_id for t in batch.trajectories],
                False,
                1,
            )
        assert await asyncio.to_thread(first.trainer.commit, ["a/0"]) == 1
    finally:
        first.stop()
    second = Running(tmp_path)
    try:
        ledger = await second.producer.ledger()
        assert (ledger.frontier, ledger.above, ledger.highest) == (1, [5], 5)
        assert ledger.whole == [1, 2] and ledger.partial == {"3": [0]}
        assert ledger.outcomes == {"trained": 1, "filtered": 1}
        resumed = await asyncio.to_thread(second.trainer.resume, [], 1, 1)
        assert resumed == ResumeAnswer(committed_groups=0, requeued_groups=1, trainer_version=1)
        batch = await asyncio.to_thread(second.trainer.get_batch, 1, 2, 1.0)
        assert [t.group_id for t in batch.trajectories] == ["b", "b", "c", "c"]
        refused = await second.producer.drop(-1, "x", "failed")
        assert not refused.accepted and "bad drop" in refused.reason
    finally:
        second.stop()
