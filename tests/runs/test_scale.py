"""Servers added and removed in the middle of a run (`rollwire scale`): the ones added
get work, the ones removed are stopped, and nothing is lost or trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import grpc
import pytest

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.runs import GUESS_RUN, ROLLWIRE, assert_no_process_left, jsonl
from tests.runs.test_faults import assert_trained_once, start_rollwire, wait_for_step


def scale(run_dir, *changes: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ROLLWIRE, "scale", str(run_dir), *changes],
        capture_output=True,
        text=True,
        timeout=360,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def generated_tokens(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=10).generated_tokens


def last_step(run_dir) -> int:
    rows = jsonl(run_dir / "metrics" / "trainer.jsonl")
    return rows[-1]["step"] if rows else 0


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_servers_added_and_removed_mid_run_get_work_and_lose_nothing(tmp_path) -> None:
    # Steps of this tiny model take a fraction of a second; starting a server takes
    # seconds: the run is long enough for both changes and the removed servers' stop.
    max_steps = 200
    run_dir = tmp_path / "run"
    overrides = [
        *GUESS_RUN,
        f"rl.max_steps={max_steps}",
        "rl.max_staleness=1",
        "run.local_env_servers=2",
        "endpoints.refresh_seconds=0.5",
        f"run.output_dir={run_dir}",
    ]
    process = start_rollwire("train", overrides, tmp_path, subprocess.PIPE)
    try:
        wait_for_step(run_dir, 2, process, timeout=300)
        added = scale(run_dir, "rollout-server=+1", "env-server=+1")
        assert added.returncode == 0, added.stdout + added.stderr
        assert "rollout-server-1 ready at" in added.stdout, added.stdout
        assert "env-server-2 ready at" in added.stdout, added.stdout
        members = json.loads((run_dir / "members.json").read_text())
        assert len(members["rollout-server"]) == 2 and len(members["env-server"]) == 3
        joined_rollout = members["rollout-server"][1]

        # The joined rollout-server takes work within a few steps (once it has the weights).
        deadline = time.monotonic() + 120
        while generated_tokens(joined_rollout) == 0:
            assert last_step(run_dir) < max_steps - 4, "the added rollout-server got no work"
            assert time.monotonic() < deadline, "the added rollout-server got no work in 120 s"
            time.sleep(0.2)

        removed = scale(run_dir, "rollout-server=-1", "env-server=-1")
        assert removed.returncode == 0, removed.stdout + removed.stderr
        assert "rollout-server-1" in removed.stdout and "env-server-2" in removed.stdout
        refused = scale(run_dir, "rollout-server=-1")  # the last one stays
        assert refused.returncode == 1 and "a role keeps one" in refused.stdout, refused.stdout
        assert last_step(run_dir) < max_steps, "the run ended before the servers were removed"
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 0, output[-3000:]
    assert "rollout-server-1 stopped" in output and "env-server-2 stopped" in output, output[-3000:]
    assert "restarting it" not in output, "a server stopped on purpose was restarted"

    # The added env-server ran episodes before it left.
    closing = [
        json.loads(line)
        for line in (run_dir / "logs" / "env-server-2.log").read_text().splitlines()
        if "closing the sessions left open" in line
    ]
    assert closing and closing[-1]["sessions_opened"] > 0, closing
    # The added rollout-server asked the trainer's store for the newest version as it
    # started (fetched it, or found the trainer's push had brought it there first).
    started = (run_dir / "logs" / "rollout-server-1.log").read_text()
    assert '"weights fetched from the trainer"' in started or '"no weights to fetch"' in started

    # Nothing lost, nothing trained twice: the trainer's record and the buffer's ledger.
    assert_trained_once(run_dir, max_steps)
    progress = jsonl(run_dir / "metrics" / "orchestrator.jsonl")[-1]
    assert progress["groups_failed"] == 0, "a group was lost with a server"
    assert all(row["sequences"] == 16 for row in jsonl(run_dir / "metrics" / "trainer.jsonl"))
    assert_no_process_left(run_dir)
