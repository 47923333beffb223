"""The launcher's side of `rollwire scale` (see `rollwire.services.app.scale`): the run's
members file, and the requests that start and stop servers of a running run."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollwire.services.app.launcher import Service, Stack
from rollwire.services.app.scale import (
    DRAIN_SECONDS,
    LAUNCHER_PID,
    READY_SECONDS,
    REQUESTS,
    SCALABLE,
    parse_changes,
)
from rollwire.services.core.config import RunConfig
from rollwire.services.core.files import write_atomically
from rollwire.services.core.members import MEMBERS_FILE, write_members


@dataclass
class _Joining:
    role: str
    service: Service
    request: str
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Request:
    id: str
    waiting: int
    """Servers of it not yet ready."""
    said: list[str] = field(default_factory=list)
    failed: bool = False


class Scaler:
    """The launcher's side: the members file, and the scale requests it carries out."""

    def __init__(self, stack: Stack, config: RunConfig, run_dir: Path) -> None:
        self.stack = stack
        self.run_dir = run_dir
        self.requests_dir = run_dir / REQUESTS
        self.requests_dir.mkdir(exist_ok=True)
        for stale in self.requests_dir.iterdir():  # a run before's requests are not this one's
            stale.unlink(missing_ok=True)
        (self.requests_dir / LAUNCHER_PID).write_text(f"{os.getpid()}\n")
        self.path = run_dir / MEMBERS_FILE
        self.grace = 2 * config.endpoints.refresh_seconds + DRAIN_SECONDS
        endpoints = config.endpoints
        started = {self._role_of(service) for service in stack.services}
        self.members: dict[str, list[str]] = {
            role: list(addresses)
            for role, addresses in (
                ("rollout-server", endpoints.rollout_servers),
                ("env-server", endpoints.env_servers),
                ("reward-server", endpoints.reward_servers),
            )
            if role in started and addresses
        }
        """The roles this launcher started, with their members' addresses."""
        self.joining: list[_Joining] = []
        self.leaving: list[tuple[Service, float]] = []
        self.open: dict[str, _Request] = {}
        write_members(self.path, self.members)

    @staticmethod
    def _role_of(service: Service) -> str:
        name = service.replica_of or service.name
        for role in SCALABLE:
            if name == role or name.startswith(f"{role}-"):
                return role
        return name

    def with_members_file(self, config: RunConfig) -> RunConfig:
        """The config whose clients read the members file."""
        endpoints = config.endpoints.model_copy(update={"members_file": str(self.path)})
        return config.model_copy(update={"endpoints": endpoints})

    def poll(self) -> list[str]:
        """Takes new requests, admits servers that became ready, stops those whose grace
        has passed; returns what happened, for the console."""
        said: list[str] = []
        for path in sorted(self.requests_dir.glob("*.request.json")):
            said += self._take(path)
        said += self._joined()
        said += self._moved()
        now = time.monotonic()
        for entry in [entry for entry in self.leaving if now >= entry[1]]:
            self.leaving.remove(entry)
            entry[0].process.signal_group(signal.SIGTERM)
            said.append(f"{entry[0].name} stopped (it left the members {self.grace:g} s ago)")
        for service in self.stack.services:  # a replica the launcher gave up on
            role = self._role_of(service)
            if service.reported and service.address in self.members.get(role, ()):
                self.members[role].remove(service.address)
                write_members(self.path, self.members)
                said.append(f"{service.name} is gone for good: it leaves the members")
        return said

    def _moved(self) -> list[str]:
        """A member restarted at another address (on a Ray cluster, on another node when
        its own left) replaces its old address in the members file."""
        said = []
        joining = {id(entry.service) for entry in self.joining}
        for service in self.stack.services:
            role = self._role_of(service)
            addresses = self.members.get(role)
            if (
                not addresses
                or service.ready_file is None
                or service.address not in addresses
                or id(service) in joining
                or not service.ready_file.exists()
            ):
                continue
            address = service.ready_file.read_text().strip()
            if address and address != service.address:
                addresses[addresses.index(service.address)] = address
                said.append(f"{service.name} serves at {address} now (was {service.address})")
                service.address = address
                write_members(self.path, self.members)
        return said

    def _take(self, path: Path) -> list[str]:
        request_id = path.name.removesuffix(".request.json")
        try:
            changes = parse_changes(json.loads(path.read_text())["changes"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            path.unlink(missing_ok=True)
            self._answer(request_id, False, [f"refused: {error}"])
            return [f"scale request refused: {error}"]
        path.unlink(missing_ok=True)
        request = _Request(request_id, 0)
        for role, change in changes.items():
            if role not in self.members:
                request.failed = True
                request.said.append(
                    f"{role}: this run's launcher started none (the run has none, or they are "
                    "named in the config's endpoints: scale those where they run)"
                )
            elif change > 0:
                for _ in range(change):
                    self._add(role, request)
            else:
                self._remove(role, -change, request)
        if request.waiting == 0:
            self._answer(request_id, not request.failed, request.said)
        else:
            self.open[request_id] = request
        return [f"scale: {line}" for line in request.said]

    def _add(self, role: str, request: _Request) -> None:
        taken = {s.name for s in self.stack.services}
        number = next(i for i in range(1, 10_000) if f"{role}-{i}" not in taken)
        extra = tuple(self.stack.late_rollout_args()) if role == "rollout-server" else ()
        service = self.stack.start(role, name=f"{role}-{number}", replica=True, extra=extra)
        self.joining.append(_Joining(role, service, request.id))
        request.waiting += 1
        request.said.append(f"{service.name} starting")

    def _remove(self, role: str, count: int, request: _Request) -> None:
        members = self.members[role]
        if count >= len(members):
            request.failed = True
            request.said.append(
                f"{role}: {len(members)} running, so at most {len(members) - 1} can go "
                "(a role keeps one)"
            )
            count = len(members) - 1
        live = [
            s
            for s in self.stack.services
            if self._role_of(s) == role and s.address in members and not s.retired
        ]
        for service in live[::-1][:count]:  # the newest first
            members.remove(service.address)
            service.retired = True
            self.leaving.append((service, time.monotonic() + self.grace))
            request.said.append(
                f"{service.name} ({service.address}) left; stopped in {self.grace:g} s"
            )
        write_members(self.path, self.members)

    def _joined(self) -> list[str]:
        said = []
        for joining in list(self.joining):
            service, request = joining.service, self.open.get(joining.request)
            ready = service.ready_file is not None and service.ready_file.exists()
            address = service.ready_file.read_text().strip() if ready else ""
            late = time.monotonic() - joining.started > READY_SECONDS
            dead = service.process.poll() is not None
            if not address and not (late or dead):
                continue
            self.joining.remove(joining)
            if address:
                service.address = address
                self.members[joining.role].append(address)
                write_members(self.path, self.members)
                line = f"{service.name} ready at {address}: it joins the run"
            else:
                service.retired = True
                service.process.signal_group(signal.SIGKILL)
                why = "exited" if dead else f"was not ready within {READY_SECONDS:g} s"
                line = f"{service.name} {why}; its log: {service.log_path}"
            said.append(line)
            if request is not None:
                request.said.append(line)
                request.failed |= not address
                request.waiting -= 1
                if request.waiting == 0:
                    del self.open[request.id]
                    self._answer(request.id, not request.failed, request.said)
        return said

    def _answer(self, request_id: str, ok: bool, said: list[str]) -> None:
        write_atomically(
            self.requests_dir / f"{request_id}.answer.json",
            json.dumps({"ok": ok, "said": said, "members": self.members}),
        )
