"""`rollwire status`: real services asked for their health, version and queues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from rollwire.services.core.config import RunConfig, write_resolved_config
from tests.conftest import ROLLWIRE, rollout_server_args

pytestmark = pytest.mark.multiproc


def status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ROLLWIRE, "status", *args], capture_output=True, text=True, timeout=timeout
    )


def env_server(spawn, tmp_path, name: str = "env") -> tuple[object, str]:
    ready = tmp_path / f"{name}.ready"
    child = spawn([*ROLLWIRE, "env-server", "--port", "0", "--ready-file", str(ready)])
    return child, child.wait_for_file(ready)


@pytest.mark.timeout(120)
def test_addresses_are_identified_and_reported(spawn, tmp_path, tiny_model_path) -> None:
    _, env_address = env_server(spawn, tmp_path)
    ready = tmp_path / "rollout.ready"
    rollout = spawn(rollout_server_args(tiny_model_path, ready))
    rollout_address = rollout.wait_for_file(ready, timeout=60)
    result = status(env_address, rollout_address, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    views = {view["address"]: view for view in json.loads(result.stdout)["services"]}
    assert views[env_address]["kind"] == "env-server"
    assert views[env_address]["health"] == "SERVING"
    assert views[env_address]["detail"]["envs"] >= 1
    assert views[rollout_address]["kind"] == "rollout-server"
    assert views[rollout_address]["version"] == 0
    assert views[rollout_address]["detail"]["engine"] == "hf"
    assert views[rollout_address]["detail"]["waiting"] == 0
    table = status(env_address, rollout_address, "--once")
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("SERVING") == 2
    assert "rollout-server" in table.stdout and "env-server" in table.stdout


@pytest.mark.timeout(120)
def test_a_frozen_service_shows_as_not_answering_within_the_deadline(spawn, tmp_path) -> None:
    child, address = env_server(spawn, tmp_path)
    os.kill(child.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        result = status(address, "--json")
        took = time.monotonic() - started
    finally:
        os.kill(child.process.pid, signal.SIGCONT)
    assert result.returncode == 1
    view = json.loads(result.stdout)["services"][0]
    assert view["health"].startswith("not answering: DEADLINE_EXCEEDED"), view
    assert took < 30, took  # the 2-second deadline, not a hang (generous for a loaded machine)
    assert status(address, "--json").returncode == 0  # and back once it runs again


def test_something_that_is_neither_a_run_nor_an_address_is_refused(tmp_path) -> None:
    result = status(str(tmp_path / "nothing-here"))
    assert result.returncode == 2
    assert "neither a run folder nor host:port" in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    result = status(str(empty))
    assert result.returncode == 2
    assert "no resolved_config.yaml" in result.stdout


@pytest.mark.timeout(120)
def test_a_run_folder_shows_its_services_progress_and_last_problem(spawn, tmp_path) -> None:
    """A run folder as `rollwire up` leaves it: endpoints in the resolved config, one JSON
    log per service, metrics files."""
    run = tmp_path / "run"
    _, env_address = env_server(spawn, tmp_path)
    config = RunConfig()
    config = config.model_copy(
        update={
            "endpoints": config.endpoints.model_copy(
                update={"env_servers": [env_address], "buffer_producer": "tcp://127.0.0.1:9"}
            )
        }
    )
    write_resolved_config(config, run)
    (run / "logs").mkdir()
    (run / "logs" / "env-server-0.log").write_text(
        json.dumps({"ts": 0, "level": "info", "msg": "serving"})
        + "\n"
        + json.dumps({"ts": 1, "level": "warning", "msg": "a retry", "error": "UNAVAILABLE"})
        + "\n"
        + json.dumps({"ts": 2, "level": "info", "msg": "fine again"})
        + "\n"
    )
    (run / "metrics").mkdir()
    (run / "metrics" / "trainer.jsonl").write_text(
        json.dumps({"step": 3, "reward_mean": 0.25, "staleness_mean": 0.5}) + "\n"
    )
    (run / "metrics" / "eval.jsonl").write_text(
        json.dumps({"policy_version": 2, "eval_reward": 0.3}) + "\n"
    )
    result = status(str(run), "--json")
    snapshot = json.loads(result.stdout)
    views = {view["name"]: view for view in snapshot["services"]}
    assert views["env-server-0"]["health"] == "SERVING"
    assert "warning: a retry (UNAVAILABLE)" in views["env-server-0"]["last_problem"]
    # Nothing listens on the buffer's port: it is shown as such, and the exit status says so.
    assert views["buffer"]["health"].startswith("not answering")
    assert result.returncode == 1
    assert snapshot["progress"] == {
        "step": 3,
        "reward_mean": 0.25,
        "staleness_mean": 0.5,
        "eval_reward": 0.3,
        "eval_version": 2,
    }
