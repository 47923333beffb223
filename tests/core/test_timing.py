"""The time breakdown every run records and `rollwire train` prints."""

from __future__ import annotations

import time

from rollwire.services.app.run import time_breakdown, weight_transport_used
from rollwire.services.core.timing import PhaseClock


def test_phases_add_up_and_take_starts_afresh() -> None:
    clock = PhaseClock()
    with clock.phase("work"):
        end = time.process_time() + 0.05
        while time.process_time() < end:  # CPU work: counted as cores used
            pass
    clock.add("wait", 0.25)
    with clock.phase("work"):
        time.sleep(0.02)  # a wait: wall time, no CPU
    taken = clock.take()
    assert taken["time_wait_seconds"] == 0.25
    assert 0.07 <= taken["time_work_seconds"] <= taken["wall_seconds"]
    assert taken["cpu_seconds"] >= 0.05
    assert 0.0 < taken["cpu_cores"] <= 1.5
    again = clock.take()
    assert "time_work_seconds" not in again and again["wall_seconds"] < taken["wall_seconds"]


def test_the_printed_breakdown_names_each_phase_and_what_is_left() -> None:
    steps = [
        {
            "wall_seconds": 2.0,
            "time_wait_seconds": 1.0,
            "time_forward_backward_seconds": 0.5,
            "time_publish_seconds": 0.2,
            "cpu_cores": 0.5,
        },
        {
            "wall_seconds": 1.0,
            "time_wait_seconds": 0.0,
            "time_forward_backward_seconds": 0.5,
            "time_publish_seconds": 0.2,
            "cpu_cores": 0.9,
        },
    ]
    progress = [
        {
            "groups_completed": 9,
            "groups_failed": 1,
            "wall_seconds": 10.0,
            "time_generate_seconds": 20.0,
            "time_score_seconds": 5.0,
            "cpu_cores": 0.3,
        }
    ]
    trainer, orchestrator = time_breakdown(steps, progress)
    assert trainer == (
        "trainer step, mean of 2: 1.500s = wait 0.500 (33%), forward/backward 0.500 (33%), "
        "publish 0.200 (13%), other 0.300; CPU 0.70 cores"
    )
    assert orchestrator == (
        "orchestrator, seconds per group (10 groups, calls overlap): generate 2.000, "
        "score 0.500; CPU 0.30 cores"
    )
    assert time_breakdown([], []) == []


def test_the_summary_says_how_the_weights_went() -> None:
    """A weight group that never formed, or broke mid-run, is said, not left to the log."""
    assert weight_transport_used([]) == ""
    group = [{"weights_by_group": 1.0}] * 3
    streams = [{"weights_by_group": 0.0}] * 2
    assert "broadcast in the weight group (3 steps)" in weight_transport_used(group)
    assert weight_transport_used(streams).endswith("gRPC streams (2 steps)")
    # Deltas or adapters: the bytes sent against whole updates.
    lighter = [dict(row, publish_bytes=1e6, publish_bytes_whole=4e6) for row in streams]
    assert weight_transport_used(lighter).endswith("2.0 MB of 8.0 MB whole (25%)")
    broke = weight_transport_used(group + streams)
    assert "3 of 5 steps" in broke and "the group failed" in broke
