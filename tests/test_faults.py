"""Fault injection: services killed with SIGKILL mid-run; the run goes on, nothing twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train import SHORT_RUN, assert_no_process_left, jsonl


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float) -> None:
    trainer_log = run_dir / "metrics" / "trainer.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        rows = jsonl(trainer_log) if trainer_log.exists() else []
        if rows and rows[-1]["step"] >= step:
            return
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached within {timeout:g}s"
        time.sleep(0.2)


def kill(run_dir: Path, name: str) -> int:
    pid = int((run_dir / "logs" / f"{name}.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    return pid


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_buffer_reward_and_rollout_servers_killed_mid_run_lose_nothing_train_nothing_twice(
    tmp_path,
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*SHORT_RUN, "rl.max_steps=8", f"run.output_dir={run_dir}"]
    command = [sys.executable, "-m", "rollwire.services.cli", "train"]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        wait_for_step(run_dir, 2, process, timeout=300)
        kill(run_dir, "buffer")
        wait_for_step(run_dir, 4, process, timeout=240)
        kill(run_dir, "reward-server")
        wait_for_step(run_dir, 6, process, timeout=240)
        kill(run_dir, "rollout-server")
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    events = [line for line in output.splitlines() if "exited" in line or "rollwire train:" in line]
    assert process.returncode == 0, "\n".join(events) + "\n" + output[-2000:]
    assert "buffer exited with code -9; restarting it" in output
    assert "reward-server exited with code -9; restarting it" in output
    assert "rollout-server exited with code -9; restarting it" in output
    assert [row["step"] for row in jsonl(run_dir / "metrics" / "trainer.jsonl")] == list(
        range(1, 9)
    )
    trained = jsonl(run_dir / "metrics" / "trained_ids.jsonl")
    ids = [i for row in trained for i in row["ids"]]
    assert len(trained) == 8 and all(len(row["ids"]) == 16 for row in trained)
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    progress = jsonl(run_dir / "metrics" / "orchestrator.jsonl")[-1]
    print(
        f"groups completed {progress['groups_completed']}, failed (relaunched) "
        f"{progress['groups_failed']}, trained {len(ids)} trajectories once each"
    )
    assert_no_process_left(run_dir)
