"""The machine-wide thread plan (`run.cpu_threads`): who computes with how many threads."""

from __future__ import annotations

import pytest

from rollwire.trainer.process.thread_plan import GIVE_ABOVE, REPLAN_STEPS, TAKE_BELOW, ThreadPlan


def test_sync_gives_the_step_every_thread_and_generation_all_but_one_and_never_moves() -> None:
    plan = ThreadPlan.start(4, sync=True)
    assert (plan.trainer, plan.rollout) == (4, 3)
    assert not plan.replan(0.9) and not plan.replan(0.0)
    assert (plan.trainer, plan.rollout) == (4, 3)
    assert (ThreadPlan.start(1, sync=True).trainer, ThreadPlan.start(1, sync=True).rollout) == (
        1,
        1,
    )


def test_async_starts_in_half_and_moves_one_thread_toward_the_side_behind() -> None:
    plan = ThreadPlan.start(5, sync=False)
    assert (plan.trainer, plan.rollout) == (2, 3)
    assert plan.replan(GIVE_ABOVE + 0.1)  # the trainer waits: generation is behind
    assert (plan.trainer, plan.rollout) == (1, 4)
    assert not plan.replan(0.9)  # the trainer keeps one thread
    assert not plan.replan((GIVE_ABOVE + TAKE_BELOW) / 2)  # between the marks: stays
    assert plan.replan(TAKE_BELOW / 2) and plan.replan(0.0) and plan.replan(0.0)
    assert (plan.trainer, plan.rollout) == (4, 1)
    assert not plan.replan(0.0)  # generation keeps one thread
    assert plan.trainer + plan.rollout == plan.total


def test_two_threads_split_one_each() -> None:
    plan = ThreadPlan.start(2, sync=False)
    assert (plan.trainer, plan.rollout) == (1, 1)
    assert not plan.replan(0.9) and not plan.replan(0.0)
    with pytest.raises(ValueError, match="at least one thread"):
        ThreadPlan.start(0, sync=True)


def test_the_plan_follows_the_idle_share_of_a_window_of_steps() -> None:
    plan = ThreadPlan.start(6, sync=False)
    for _ in range(REPLAN_STEPS - 1):
        assert not plan.observe(waited=0.5, wall=1.0)  # not yet a window
    assert plan.observe(waited=0.5, wall=1.0)  # idle 0.5: one thread to generation
    assert (plan.trainer, plan.rollout) == (2, 4)
    for _ in range(REPLAN_STEPS):
        changed = plan.observe(waited=0.01, wall=1.0)  # hardly waits: one back
    assert changed and (plan.trainer, plan.rollout) == (3, 3)
    assert plan.per_server(2) == 1 and plan.per_server(1) == 3 and plan.per_server(5) == 1


class _Stub:
    """A rollout-server's SetThreads, answering as an engine that can (or cannot) change."""

    def __init__(self, reason: str = "") -> None:
        self.reason, self.asked = reason, []

    async def SetThreads(self, request, timeout):  # the gRPC method's name
        from rollwire.proto.v1 import rollout_pb2

        self.asked.append(request.threads)
        return rollout_pb2.SetThreadsResponse(
            applied=not self.reason, threads=request.threads, reason=self.reason
        )


class _Policy:
    def __init__(self, reason: str | None = None) -> None:
        self.reason, self.threads = reason, None

    def set_threads(self, threads: int) -> str | None:
        self.threads = threads
        return self.reason


async def test_the_trainer_hands_out_the_plan_and_borrows_threads_beside_a_fixed_engine() -> None:
    from rollwire.trainer.process.loop import follow_plan

    plan = ThreadPlan.start(6, sync=False)
    policy, stubs = _Policy(), [_Stub(), _Stub()]
    await follow_plan(plan, policy, stubs)
    assert policy.threads == 3 and [s.asked for s in stubs] == [[1], [1]]  # 3 shared by 2
    assert plan.fixed is None and plan.replan(0.9)

    vllm = _Stub("vLLM binds its CPU threads when it starts")
    await follow_plan(plan, policy, [vllm])
    assert vllm.asked == [4] and plan.rollout_fixed == "rollout-server: " + vllm.reason
    assert plan.fixed is None and (plan.trainer, plan.rollout) == (2, 4)
    # Generation keeps its 4; a trainer that hardly waits borrows up to every thread...
    assert all(plan.replan(0.0) for _ in range(4)) and not plan.replan(0.0)
    assert (plan.trainer, plan.rollout) == (6, 4)
    await follow_plan(plan, policy, [vllm])
    assert policy.threads == 6 and vllm.asked == [4]  # the engine is not asked again
    # ...and one that waits gives them back, down to what generation leaves it.
    assert all(plan.replan(0.9) for _ in range(4)) and not plan.replan(0.9)
    assert (plan.trainer, plan.rollout) == (2, 4)
    assert not plan.replan((GIVE_ABOVE + TAKE_BELOW) / 2)

    fsdp = ThreadPlan.start(4, sync=True)
    fsdp_stub = _Stub()
    await follow_plan(fsdp, _Policy("the fsdp2 backend's ranks keep their threads"), [fsdp_stub])
    assert fsdp.fixed.startswith("trainer: the fsdp2 backend") and fsdp_stub.asked == []
    wide = ThreadPlan.start(8, sync=False)
    wide.fixed = fsdp.fixed
    assert not wide.replan(0.0) and not wide.replan(0.9)


def test_generation_keeps_a_thread_for_each_rollout_server() -> None:
    sync = ThreadPlan.start(2, sync=True, servers=2)
    assert (sync.trainer, sync.rollout, sync.per_server(2)) == (2, 2, 1)
    assert sync.describe() == "trainer 2, rollout-servers 2 x 1"
    assert ThreadPlan.start(2, sync=True).describe() == "trainer 2, rollout-server 1"
    plan = ThreadPlan.start(6, sync=False, servers=2)
    assert (plan.trainer, plan.rollout, plan.per_server(2)) == (3, 3, 1)
    assert plan.replan(GIVE_ABOVE + 0.1) and plan.per_server(2) == 2  # 4 threads, 2 each
    assert plan.replan(0.0) and plan.replan(0.0)
    assert (plan.trainer, plan.rollout) == (4, 2)
    assert not plan.replan(0.0)  # one thread per server stays with generation
