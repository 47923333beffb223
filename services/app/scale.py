"""`rollwire scale`: more or fewer rollout-, env- and reward-servers in a running run.

    rollwire scale runs/default rollout-server=+1
    rollwire scale runs/default env-server=-1 rollout-server=+1

This module is the command's side, light (no model code); the launcher's side is
`rollwire.services.app.scaler`. The command leaves a request in the run folder (`scale/<id>.request.json`); the
launcher of the run (`rollwire train` or `up`) takes it at its next look, half a
second at most, and answers in `scale/<id>.answer.json`, which the command prints.

The launcher keeps the run's members file (`members.json`, named by
`endpoints.members_file` in the resolved config), which the orchestrator and the
trainer read again every `endpoints.refresh_seconds`:

- a server added is started like the others; once it is ready its address goes into
  the members file, and the orchestrator sends it work once it serves the policy
  version the others serve (the trainer sends it the weights first);
- a server removed leaves the members file at once (no new work goes to it), and its
  process is stopped `2 x refresh_seconds + drain_seconds` later, when every client
  has seen it leave; a call still in flight on it then fails over to another server
  (the orchestrator's retries), and an episode on a removed env-server restarts from
  its seed elsewhere. Groups are never lost or trained twice: the buffer's ledger is
  the one record of what was trained.

A role never goes below one server. Servers named by the config
(`endpoints.*_servers`) rather than started by the launcher are not the launcher's to
scale.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from rollwire.services.core.files import write_atomically
from rollwire.services.core.members import MEMBERS_FILE

SCALABLE = ("rollout-server", "env-server", "reward-server")
REQUESTS = "scale"
LAUNCHER_PID = "launcher.pid"
"""In the requests folder: the pid of the launcher that takes them."""
DRAIN_SECONDS = 5.0
"""Beyond two refreshes, how long a removed server is left to finish what it has."""
READY_SECONDS = 300.0
"""How long an added server may take to be ready (a model to load) before the request fails."""


class ScaleError(ValueError):
    """A scale request that cannot be done; the message says why."""


def parse_changes(words: list[str]) -> dict[str, int]:
    """`role=+N` / `role=-N` words as {role: change} (ScaleError naming what is wrong)."""
    changes: dict[str, int] = {}
    for word in words:
        role, _, amount = word.partition("=")
        if role not in SCALABLE:
            raise ScaleError(f"{word!r}: the role must be one of {', '.join(SCALABLE)}")
        try:
            change = int(amount)
        except ValueError:
            raise ScaleError(
                f"{word!r}: give the change as a signed count, e.g. {role}=+1"
            ) from None
        if change == 0 or not amount.startswith(("+", "-")):
            raise ScaleError(f"{word!r}: give the change as a signed count, e.g. {role}=+1")
        changes[role] = changes.get(role, 0) + change
    if not changes:
        raise ScaleError("nothing to change: give one or more role=+N / role=-N")
    return changes


def request_scale(run_dir: Path, words: list[str], timeout: float = READY_SECONDS + 30) -> int:
    """`rollwire scale RUN_DIR role=+N ...`: asks the run's launcher and prints its answer."""
    try:
        parse_changes(words)
    except ScaleError as error:
        print(f"rollwire scale: {error}")
        return 2
    requests = run_dir / REQUESTS
    if not (run_dir / MEMBERS_FILE).exists() or not requests.is_dir():
        print(
            f"rollwire scale: {run_dir} is not the folder of a run started by `rollwire train` "
            "or `up` (no members.json)"
        )
        return 2
    request_id = uuid.uuid4().hex[:12]
    write_atomically(requests / f"{request_id}.request.json", json.dumps({"changes": words}))
    answer = requests / f"{request_id}.answer.json"
    started = time.monotonic()
    warned = False
    while time.monotonic() - started < timeout:
        if answer.exists():
            result = json.loads(answer.read_text())
            answer.unlink(missing_ok=True)
            for line in result["said"]:
                print(line)
            members = result["members"]
            print("members: " + "; ".join(f"{k} {len(v)}" for k, v in sorted(members.items())))
            return 0 if result["ok"] else 1
        if not _launcher_alive(requests):
            print("rollwire scale: the run's launcher has ended (the run is over or was stopped)")
            return 1
        if not warned and time.monotonic() - started > 10:
            warned = True
            if (requests / f"{request_id}.request.json").exists():
                print(
                    "rollwire scale: the run's launcher has not taken the request in 10 s: "
                    "is the run still going?"
                )
        time.sleep(0.2)
    print(f"rollwire scale: no answer within {timeout:g} s")
    return 1


def _launcher_alive(requests: Path) -> bool:
    """Whether the launcher that wrote the requests folder's pid file still runs."""
    try:
        pid = int((requests / LAUNCHER_PID).read_text())
    except (OSError, ValueError):
        return True  # not written yet: the wait's own limit applies
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
