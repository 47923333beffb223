"""Fault injection: every kind of process killed with SIGKILL at a random moment of one
run; the run goes on, and the trainer's record shows every prompt trained exactly once
or dropped with a reason, nothing twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollwire.services.buffer.durable_log import DurableLog
from tests.helpers.runs import SHORT_RUN, assert_no_process_left, jsonl

KINDS = ("buffer", "reward-server", "rollout-server", "orchestrator", "trainer")


def start_rollwire(
    command: str, overrides: list[str], tmp_path: Path, output: int
) -> subprocess.Popen:
    """`rollwire COMMAND --set ...` in its own session, with a private model cache."""
    argv = [sys.executable, "-m", "rollwire.services.app.cli", command]
    for item in overrides:
        argv += ["--set", item]
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def wait_for_step(
    run_dir: Path, step: int, process: subprocess.Popen, timeout: float, context: str = ""
) -> float:
    """Waits until the trainer has recorded `step`; returns the seconds its recent steps
    took each (what "somewhere inside the next step" means on this machine today)."""
    trainer_log = run_dir / "metrics" / "trainer.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        rows = jsonl(trainer_log) if trainer_log.exists() else []
        if rows and rows[-1]["step"] >= step:
            recent = rows[-4:]
            if len(recent) < 2:
                return 0.1
            return (recent[-1]["time"] - recent[0]["time"]) / (len(recent) - 1)
        assert process.poll() is None, context + "\n" + process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, (
            f"step {step} not reached within {timeout:g}s; {context}"
        )
        time.sleep(0.05)


def kill(run_dir: Path, name: str, launcher: subprocess.Popen, context: str) -> int:
    """SIGKILL to the process group of `name`'s current process. A pid file naming a
    process already gone (the launcher is starting it again) is read again until the new
    process has written its own, for up to 30 s."""
    deadline = time.monotonic() + 30
    while True:
        pid = int((run_dir / "logs" / f"{name}.pid").read_text())
        try:
            os.killpg(pid, signal.SIGKILL)
            return pid
        except ProcessLookupError:
            if launcher.poll() is not None or time.monotonic() > deadline:
                output = launcher.communicate(timeout=30)[0] if launcher.poll() is not None else ""
                log = (run_dir / "logs" / f"{name}.log").read_text()[-3000:]
                raise AssertionError(
                    f"{name}: no live process in its pid file (launcher "
                    f"{'exited ' + str(launcher.returncode) if launcher.poll() is not None else 'running'}); "
                    f"{context}\nlauncher output:\n{output[-3000:]}\n{name}.log:\n{log}"
                ) from None
            time.sleep(0.2)


def effective_training(records: list[dict]) -> list[dict]:
    """The steps the final model went through: a resume from step k undoes the steps
    after k that the trainer before it had taken."""
    steps: list[dict] = []
    for record in records:
        if "resumed_from_step" in record:
            del steps[record["resumed_from_step"] :]
        else:
            assert record["step"] == len(steps) + 1, f"step {record['step']} out of order"
            steps.append(record)
    return steps


def buffer_outcomes(buffer_dir: Path) -> dict[int, list[str]]:
    """What the buffer's log says became of each prompt ordinal it finished."""
    outcomes: dict[int, list[str]] = {}
    with DurableLog(buffer_dir) as log:
        assert log.first_offset == 0, "segments were deleted: per-ordinal records are gone"
        for _, record in log.replay():
            if record[:1] == b"C":
                data = json.loads(record[1:])
                for ordinal in data["ordinals"]:
                    outcomes.setdefault(int(ordinal), []).append(data["outcome"])
    return outcomes


def assert_trained_once(run_dir: Path, max_steps: int, context: str = "") -> dict[int, str]:
    """Exactly once, from the trainer's record and the buffer's log: the final lineage has
    `max_steps` steps, no trajectory and no prompt in it twice, every ordinal the buffer
    finished ended one way, and its "trained" are exactly the lineage's prompts. Returns
    how each ordinal ended."""
    steps = effective_training(jsonl(run_dir / "metrics" / "trained_ids.jsonl"))
    assert len(steps) == max_steps, context
    ids = [i for step in steps for i in step["ids"]]
    assert len(ids) == len(set(ids)), f"a trajectory was trained twice; {context}"
    trained = [o for step in steps for o in step["ordinals"]]
    assert len(trained) == len(set(trained)), f"a prompt was trained twice; {context}"
    outcomes = buffer_outcomes(run_dir / "buffer")
    assert all(len(ways) == 1 for ways in outcomes.values()), f"an ordinal ended twice; {context}"
    ended = {o: ways[0] for o, ways in outcomes.items()}
    assert {o for o, way in ended.items() if way == "trained"} == set(trained), context
    return ended


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_every_kind_of_process_killed_mid_run_loses_nothing_and_trains_nothing_twice(
    tmp_path,
) -> None:
    seed = int(os.environ.get("ROLLWIRE_FAULT_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    order = rng.sample(KINDS, len(KINDS))
    # Steps of this tiny model take a fraction of a second, restarts take seconds; the last
    # kill comes at step 28, well before the run can end.
    max_steps = 48
    run_dir = tmp_path / "run"
    overrides = [
        *SHORT_RUN,
        f"rl.max_steps={max_steps}",
        "trainer.checkpointing.every=2",
        f"run.output_dir={run_dir}",
    ]
    process = start_rollwire("train", overrides, tmp_path, subprocess.PIPE)
    killed: list[tuple[str, int, float]] = []
    try:
        for n, name in enumerate(order):
            step = 4 + 6 * n
            context = f"seed {seed} (ROLLWIRE_FAULT_SEED), kills {killed}"
            step_seconds = wait_for_step(run_dir, step, process, timeout=300, context=context)
            # Somewhere inside the step that follows. A fixed span would not do: steps of
            # this tiny model take 0.01-0.5 s, and a run that ended before its last kill
            # leaves that process nothing to kill.
            delay = rng.uniform(0.0, min(step_seconds, 2.0))
            time.sleep(delay)
            kill(run_dir, name, process, context)
            killed.append((name, step, round(delay, 2)))
        output, _ = process.communicate(timeout=500)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    context = f"seed {seed} (ROLLWIRE_FAULT_SEED), kills {killed}"
    events = [line for line in output.splitlines() if "exited" in line or "rollwire train:" in line]
    assert process.returncode == 0, context + "\n" + "\n".join(events) + "\n" + output[-2000:]
    for name in KINDS:
        assert f"{name} exited with code -9; restarting it" in output, (name, context)

    # Every ordinal below the buffer's frontier ended exactly one way, with its reason;
    # the buffer's "trained" is exactly what the trainer's final lineage trained.
    ended = assert_trained_once(run_dir, max_steps, context)
    records = jsonl(run_dir / "metrics" / "trained_ids.jsonl")
    steps = effective_training(records)
    ids = [i for step in steps for i in step["ids"]]
    trained = [o for step in steps for o in step["ordinals"]]
    frontier = 0
    while frontier in ended:
        frontier += 1
    assert frontier >= max_steps * 4 - 8, f"frontier {frontier}; {context}"
    dropped = {way: sum(1 for w in ended.values() if w == way) for way in set(ended.values())}

    # Bounded staleness held on every trained token, restarts or not.
    metrics = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert max(row["staleness_max"] for row in metrics) <= 1, context
    reports = jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    progress = reports[-1] if reports else {}
    resumes = sum(1 for r in records if "resumed_from_step" in r)
    print(
        f"\n{context}\n"
        f"killed {len(killed)} processes; trainer resumes {resumes}; groups relaunched after a "
        f"failure {progress.get('groups_failed')}, rerun from the ledger {progress.get('groups_resumed')}; "
        f"ordinals below the frontier {frontier}: {dropped}; trained {len(ids)} trajectories "
        f"({len(trained)} prompts) once each in {max_steps} steps"
    )
    assert_no_process_left(run_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_services_end_when_their_launcher_is_killed(tmp_path) -> None:
    """SIGKILL gives `rollwire up` no chance to stop its services; they end on their own."""
    run_dir = tmp_path / "run"
    launcher = start_rollwire(
        "up", [*SHORT_RUN, f"run.output_dir={run_dir}"], tmp_path, subprocess.DEVNULL
    )
    names = ("buffer", "reward-server", "rollout-server")
    deadline = time.monotonic() + 240
    while not all((run_dir / "logs" / f"{name}.ready").exists() for name in names):
        assert launcher.poll() is None and time.monotonic() < deadline, "the stack did not start"
        time.sleep(0.2)
    pids = [int((run_dir / "logs" / f"{name}.pid").read_text()) for name in names]
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, not its services' groups
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        time.sleep(0.2)
    for pid in alive:  # clean up before failing
        os.killpg(pid, signal.SIGKILL)
    assert alive == [], "services outlived their launcher"
    assert_no_process_left(run_dir)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def trainer_rank_pid(run_dir: Path, rank: int, timeout: float = 60) -> int:
    """The pid of trainer rank `rank`: a child of the trainer's torchrun (its pid file)
    whose environment says RANK=rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parent = int((run_dir / "logs" / "trainer.pid").read_text())
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            children = []
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
        time.sleep(0.2)
    raise AssertionError(f"no trainer rank {rank} found within {timeout:g}s")


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_killed_trainer_rank_restarts_the_group_and_a_two_rank_run_resumes(tmp_path) -> None:
    """trainer.world_size 2 (fsdp2): rank 1 killed mid-run takes the group down, the
    launcher starts the group again from its checkpoint, nothing is trained twice; a
    second `rollwire train` on the same run directory resumes on two ranks."""
    run_dir = tmp_path / "run"
    overrides = [
        *SHORT_RUN,
        "rl.max_steps=12",
        "trainer.checkpointing.every=2",
        "trainer.backend=fsdp2",
        "trainer.world_size=2",
        f"run.output_dir={run_dir}",
    ]
    process = start_rollwire("train", overrides, tmp_path, subprocess.PIPE)
    try:
        wait_for_step(run_dir, 5, process, timeout=300)
        follower = trainer_rank_pid(run_dir, 1)
        os.kill(follower, signal.SIGKILL)
        output, _ = process.communicate(timeout=500)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 0, output[-3000:]
    assert "trainer exited with code 1; restarting it" in output, output[-3000:]
    records = jsonl(run_dir / "metrics" / "trained_ids.jsonl")
    assert any("resumed_from_step" in r for r in records), records[-3:]
    steps = effective_training(records)
    assert len(steps) == 12
    ids = [i for step in steps for i in step["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    final = run_dir / "checkpoints" / "step_000012"
    assert (final / "backend").is_dir() and (final / "model.safetensors").exists()

    # Again on the same directory, further: it resumes from step 12 on two ranks.
    process = start_rollwire(
        "train",
        [*overrides[:-1], "rl.max_steps=14", f"run.output_dir={run_dir}"],
        tmp_path,
        subprocess.PIPE,
    )
    output, _ = process.communicate(timeout=500)
    assert process.returncode == 0, output[-3000:]
    records = jsonl(run_dir / "metrics" / "trained_ids.jsonl")
    assert records[-3]["resumed_from_step"] == 12, records[-3:]
    steps = effective_training(records)
    assert [s["step"] for s in steps] == list(range(1, 15))
    ids = [i for step in steps for i in step["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice across the resume"
    assert_no_process_left(run_dir)
