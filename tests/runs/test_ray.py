"""A run placed on a Ray cluster of two nodes on this machine (two raylets this test
starts and stops by process group): its services spread over both, the trainer's two
ranks gang-placed, one node's processes killed mid-run, and the run ends with nothing
lost, nothing trained twice and the held-out reward risen; and a trainer whose ranks
span both nodes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.runs import SHORT_RUN, assert_no_process_left, child_env, jsonl, train_command
from tests.runs.test_faults import assert_trained_once

RAY = Path(sys.executable).parent / "ray"
pytestmark = pytest.mark.skipif(not RAY.exists(), reason="Ray is not installed (rollwire[ray])")


def start_node(log: Path, temp_dir: str, label: str, head_address: str | None) -> subprocess.Popen:
    """`ray start --block` in its own session: the node's raylet and workers are its
    process group. `label` is a custom resource that names the node."""
    argv = [
        str(RAY),
        "start",
        "--block",
        "--num-cpus=8",
        f"--resources={json.dumps({label: 1000})}",
        "--node-ip-address=127.0.0.1",
        "--disable-usage-stats",
    ]
    if head_address is None:
        argv += ["--head", "--port=0", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
    else:
        argv += [f"--address={head_address}"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_for_text(log: Path, pattern: str, node: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        assert node.poll() is None, f"the Ray node exited: {log.read_text()[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(
        f"{pattern!r} not in {log} within {timeout:g}s:\n{log.read_text()[-2000:]}"
    )


@pytest.fixture
def two_nodes(tmp_path) -> Iterator[tuple[str, dict[str, subprocess.Popen]]]:
    # A short root: Ray's socket paths under it must fit in 107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rw-ray-", dir="/tmp")
    nodes: dict[str, subprocess.Popen] = {}
    try:
        nodes["node_a"] = start_node(tmp_path / "ray-a.log", temp_dir, "node_a", None)
        address = wait_for_text(
            tmp_path / "ray-a.log", r"--address='([^']+)'", nodes["node_a"], 120
        ).group(1)
        nodes["node_b"] = start_node(tmp_path / "ray-b.log", temp_dir, "node_b", address)
        wait_for_text(tmp_path / "ray-b.log", r"Ray runtime started", nodes["node_b"], 120)
        yield address, nodes
    finally:
        for node in nodes.values():
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def placements(run_dir: Path) -> dict[str, str]:
    """Service name -> the label of the node it last started on (its `.node` file)."""
    found = {}
    for path in (run_dir / "logs").glob("*.node"):
        labels = json.loads(path.read_text())["labels"]
        found[path.name.removesuffix(".node")] = next(
            (label for label in labels if label.startswith("node_")), "?"
        )
    return found


def start_train(tmp_path: Path, run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """`rollwire train` in its own session, with the session's model cache (the default
    run's warm-up is built once for the tests) and its output in tmp_path/train.out: a
    warm-up's progress would fill an unread pipe and block it."""
    with (tmp_path / "train.out").open("w") as output_file:
        return subprocess.Popen(
            train_command(run_dir, *overrides),
            stdout=output_file,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )


def wait_for_steps(
    tmp_path: Path, run_dir: Path, steps: int, process: subprocess.Popen, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    trainer_rows = run_dir / "metrics" / "trainer.jsonl"
    while not (trainer_rows.exists() and len(jsonl(trainer_rows)) >= steps):
        assert process.poll() is None and time.monotonic() < deadline, (
            f"step {steps} not reached: "
            + (tmp_path / "train.out").read_text(errors="replace")[-3000:]
        )
        time.sleep(0.2)


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
def test_a_run_spread_over_two_ray_nodes_survives_losing_one(tmp_path, two_nodes) -> None:
    address, nodes = two_nodes
    run_dir = tmp_path / "run"
    # The default run, shortened as tests/runs/test_train.py's test_default_run_learns
    # shortens it (sync: its curve is the same run after run).
    max_steps = 30
    # Two trainer ranks (fsdp2 over gloo): a placement group reserves both, on one node.
    overrides = [
        f"rl.max_steps={max_steps}",
        "rl.mode=sync",
        "trainer.checkpointing.every=2",
        "trainer.backend=fsdp2",
        "trainer.world_size=2",
        f"run.ray={{address: '{address}'}}",
    ]
    process = start_train(tmp_path, run_dir, overrides)
    output_path = tmp_path / "train.out"
    try:
        # The warm-up is built first when no test before this one built it (minutes).
        wait_for_steps(tmp_path, run_dir, 6, process, timeout=720)
        placed = placements(run_dir)
        assert set(placed) == {
            "buffer",
            "reward-server",
            "rollout-server",
            "trainer",
            "orchestrator",
        }
        on_b = sorted(name for name, label in placed.items() if label == "node_b")
        assert on_b and len(on_b) < len(placed), f"not spread over both nodes: {placed}"
        os.killpg(nodes["node_b"].pid, signal.SIGKILL)  # the raylet, its workers, their services
        nodes["node_b"].wait(timeout=30)
        process.wait(timeout=420)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    output = output_path.read_text(errors="replace")
    context = f"placed {placed}; output:\n{output[-4000:]}"
    assert process.returncode == 0, context
    for name in on_b:
        assert f"{name} exited with code -9; restarting it" in output, (name, context)
    assert all(label == "node_a" for label in placements(run_dir).values()), context

    ended = assert_trained_once(run_dir, max_steps, context)
    evals = jsonl(run_dir / "metrics" / "eval.jsonl")
    assert evals and evals[-1]["policy_version"] >= max_steps, context
    start, end = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    print(
        f"\nservices on node_b, lost at step 6 and restarted on node_a: {on_b}; "
        f"held-out reward {start:.3f} -> {end:.3f}; "
        f"{sum(way == 'trained' for way in ended.values())} prompts trained once each in "
        f"{max_steps} steps"
    )
    assert end >= start + 0.3, f"held-out reward {start:.3f} -> {end:.3f}; {context}"
    assert_no_process_left(run_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_trainer_ranks_spread_over_two_ray_nodes_then_sigterm_stops_every_service(
    tmp_path, two_nodes
) -> None:
    """`run.ray.trainer_nodes: 2`: one fsdp2 rank on each node, reserved together, rank 1's
    torchrun joining rank 0's rendezvous on the other node; they train together. Then
    SIGTERM to the launcher stops every service the way Ctrl-C does (ray.init replaces
    the launcher's SIGTERM handler with one that dumps a stack and exits: it is put back)."""
    address, _ = two_nodes
    run_dir = tmp_path / "run"
    overrides = [
        *SHORT_RUN,
        "rl.max_steps=200",
        "trainer.backend=fsdp2",
        "trainer.world_size=2",
        f"run.ray={{address: '{address}', trainer_nodes: 2}}",
    ]
    process = start_train(tmp_path, run_dir, overrides)
    output_path = tmp_path / "train.out"
    try:
        wait_for_steps(tmp_path, run_dir, 2, process, timeout=300)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    output = output_path.read_text(errors="replace")
    assert process.returncode == 130, output[-3000:]  # interrupted, as by Ctrl-C
    assert "interrupted: stopping every service" in output
    trainer = json.loads((run_dir / "logs" / "trainer.node").read_text())
    assert trainer["labels"] == ["node_a", "node_b"] and len(trainer["nodes"]) == 2, trainer
    log = (run_dir / "logs" / "trainer.log").read_text()
    # Rank 1 ran on the second node's torchrun (one rank each), not beside rank 0.
    assert "rank 1 of 2" in log and "(node rank 1)" in log, log[-2000:]
    for name in ("buffer", "reward-server", "rollout-server"):
        assert '"msg": "stopped"' in (run_dir / "logs" / f"{name}.log").read_text(), name
    assert_no_process_left(run_dir)
