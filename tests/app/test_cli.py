"""The `rollwire` command as real processes: light services start without torch,
answer health checks, stop cleanly on SIGTERM; planned commands say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# Runs the CLI with torch and transformers made unimportable, so a light
# service that reached for them would fail loudly.
WITHOUT_TORCH = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: light services must not import it")
sys.meta_path.insert(0, _Blocked())
from rollwire.services.app.cli import main
sys.exit(main(sys.argv[1:]))
"""
CLI = [sys.executable, "-c", WITHOUT_TORCH]
REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def check_service_lifecycle(
    spawn, command: list[str], tmp_path: Path, health_cli: list[str]
) -> str:
    """Starts a service on port 0, checks SERVING through `rollwire health`, SIGTERMs it; returns its stderr."""
    ready = tmp_path / "ready"
    child = spawn([*command, "--port", "0", "--ready-file", str(ready)])
    address = child.wait_for_file(ready)
    assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    health = subprocess.run(
        [*health_cli, "health", address, "--wait", "--timeout", "20"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
    code, _, err = child.terminate()
    assert code == 0, err
    assert not ready.exists(), "the ready file should be removed on a clean stop"
    events = [json.loads(line)["msg"] for line in err.splitlines() if line.startswith("{")]
    assert events.count("serving") == 1 and events[-2:] == ["stopping", "stopped"]
    return err


@pytest.mark.multiproc
@pytest.mark.parametrize("service", ["env-server", "reward-server"])
def test_light_service_serves_without_torch_and_stops_on_sigterm(spawn, tmp_path, service) -> None:
    err = check_service_lifecycle(spawn, [*CLI, service], tmp_path, CLI)
    assert "blocked" not in err
    if service == "reward-server":  # it says which scorer serves each domain
        assert "code -> code_score (bwrap sandbox)" in err and "math -> math_score" in err


@pytest.mark.multiproc
def test_light_install_in_its_own_environment(spawn, tmp_path) -> None:
    """The done criterion as stated: a virtual environment with only rollwire[env,reward], no torch."""
    light = REPO / ".venv-light" / "bin" / "python"
    python = os.environ.get("ROLLWIRE_LIGHT_PYTHON") or (str(light) if light.exists() else None)
    if not python:
        pytest.skip(
            "no light environment: run `bash deploy/install.sh` (the README's install command), "
            "or set ROLLWIRE_LIGHT_PYTHON to a venv's python holding only rollwire[env,reward]"
        )
    no_torch = subprocess.run(
        [python, "-c", "import torch"], capture_output=True, text=True, timeout=60
    )
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    rollwire = str(Path(python).parent / "rollwire")
    for service in ("env-server", "reward-server"):
        check_service_lifecycle(spawn, [rollwire, service], tmp_path / service, [rollwire])


@pytest.mark.multiproc
@pytest.mark.parametrize("service", ["env-server", "reward-server"])
def test_help_imports_no_torch(service) -> None:
    code = (
        "import sys\nfrom rollwire.services.app.cli import main\n"
        f"try:\n    main([{service!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers', 'grpc', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "--ready-file" in out.stdout
    assert out.stdout.strip().endswith("heavy: []")


@pytest.mark.multiproc
def test_top_level_help_lists_every_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in (
        "env-server",
        "reward-server",
        "rollout-server",
        "buffer",
        "trainer",
        "orchestrator",
        "up",
        "train",
        "env-check",
        "health",
    ):
        assert command in result.stdout


@pytest.mark.multiproc
def test_config_errors_name_the_key_and_exit_2(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("env_server:\n  max_sesions: 3\n")
    result = run_cli("env-server", "-c", str(path))
    assert result.returncode != 0
    assert "env_server.max_sesions: unknown key" in result.stderr
    bad_port = run_cli("env-server", "--port", "70000")
    assert bad_port.returncode != 0 and "less than or equal to 65535" in bad_port.stderr


@pytest.mark.multiproc
def test_config_command_prints_the_resolved_config(tmp_path) -> None:
    result = run_cli("config", "--set", "run.seed=11", "--set", "env_server.max_sessions=9")
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(result.stdout)
    assert data["run"]["seed"] == 11 and data["env_server"]["max_sessions"] == 9


@pytest.mark.multiproc
def test_run_dir_receives_the_resolved_config(spawn, tmp_path) -> None:
    ready, run_dir = tmp_path / "ready", tmp_path / "run"
    child = spawn(
        [
            *CLI,
            "env-server",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--run-dir",
            str(run_dir),
            "--set",
            "env_server.max_sessions=5",
        ]
    )
    child.wait_for_file(ready)
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert resolved["env_server"]["max_sessions"] == 5
    assert resolved["env_server"]["server"]["ready_file"] == str(ready)
    assert child.terminate()[0] == 0


@pytest.mark.multiproc
def test_health_of_a_dead_address_fails_clearly() -> None:
    result = run_cli("health", "127.0.0.1:1", "--timeout", "0.5")
    assert result.returncode == 1
    assert "127.0.0.1:1: UNAVAILABLE" in result.stderr
