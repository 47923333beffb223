"""The committed generated code matches the .proto files; lint and import rules hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollwire.services.app import protogen

REPO = Path(__file__).resolve().parents[2]


def run_check(proto_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollwire.services.app.protogen",
            "--check",
            "--proto-dir",
            str(proto_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_generated_code_matches_the_protos() -> None:
    result = run_check(protogen.PROTO_DIR)
    assert result.returncode == 0, result.stderr


def copy_protos(tmp_path: Path) -> Path:
    folder = tmp_path / "proto" / "v1"
    shutil.copytree(protogen.PROTO_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_editing_a_proto_without_regenerating_fails_the_check(tmp_path) -> None:
    folder = copy_protos(tmp_path)
    proto = folder / "env.proto"
    proto.write_text(
        proto.read_text().replace("bool existed = 1;", "bool existed = 1;\n  string note = 2;")
    )
    result = run_check(folder)
    assert result.returncode == 1
    assert "env_pb2.py: differs from its .proto" in result.stderr


def test_a_missing_or_orphaned_generated_file_fails_the_check(tmp_path) -> None:
    folder = copy_protos(tmp_path)
    (folder / "reward_pb2_grpc.py").unlink()
    (folder / "old_pb2.py").write_text("# left behind\n")
    result = run_check(folder)
    assert result.returncode == 1
    assert "reward_pb2_grpc.py: missing" in result.stderr
    assert "old_pb2.py: generated file with no .proto behind it" in result.stderr


def test_regenerating_restores_a_clean_check(tmp_path) -> None:
    folder = copy_protos(tmp_path)
    (folder / "trainer_pb2.pyi").write_text("stale\n")
    write = subprocess.run(
        [sys.executable, "-m", "rollwire.services.app.protogen", "--proto-dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert write.returncode == 0, write.stderr
    assert run_check(folder).returncode == 0


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to this python; install the dev extra")
    return str(path)


def test_ruff_lint_and_format_are_clean() -> None:
    ruff = _tool("ruff")
    lint = subprocess.run(
        [ruff, "check", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_import_contracts_hold() -> None:
    """The floors of ARCHITECTURE.md hold (no file imports a floor above its own, rooms use
    each other's clients only), no two files import each other in a loop, envs, reward,
    config and the wire schema never import torch, and config imports no grpc."""
    result = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
