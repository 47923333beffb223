"""Who serves a run: each role's members, from a source that can change during the run.

A role (`rollout-server`, `reward-server`, `env-server`) gets its addresses from
the run's endpoints, read again every `endpoints.refresh_seconds`:

- `host:port` entries are members as they are;
- a `dns:///name:port` entry stands for every address the name resolves to now (a
  compose service scaled with `--scale`, a Kubernetes headless service): replicas
  that appear or go are members that join or leave;
- `endpoints.members_file`, a JSON object of role -> addresses, replaces a role's
  list where it names the role. The local launcher writes one in the run folder and
  `rollwire scale` changes it through the launcher.

`Membership.refresh` says who joined and who left since it last looked. A source
that cannot be read (a name that does not resolve for a moment, a file being
replaced) keeps the members it had, logged and counted in `members_unreadable{role}`:
a blip never empties a role.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollwire.services.core.files import write_atomically
from rollwire.services.core.metrics import COUNTERS

if TYPE_CHECKING:
    from rollwire.services.core.config import EndpointsConfig

log = logging.getLogger(__name__)

ROLES = ("rollout-server", "reward-server", "env-server")
MEMBERS_FILE = "members.json"
"""The launcher's members file, in the run folder."""
DNS_PREFIX = "dns:///"

Resolver = Callable[[str, int], list[str]]


def expand_addresses(addresses: Sequence[str], resolve: Resolver | None = None) -> list[str]:
    """`host:port` entries as they are; each `dns:///name:port` as every address it
    resolves to (ValueError if it resolves to none)."""
    resolve = resolve or resolve_name
    expanded: list[str] = []
    for address in addresses:
        if not address.startswith(DNS_PREFIX):
            if address not in expanded:
                expanded.append(address)
            continue
        target = address.removeprefix(DNS_PREFIX)
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {address!r} must look like dns:///name:port")
        found = resolve(host, int(port))
        if not found:
            raise ValueError(f"{address!r} resolves to no address")
        expanded.extend(a for a in found if a not in expanded)
    return expanded


def resolve_name(host: str, port: int) -> list[str]:
    """Every address `host` resolves to now, as `ip:port` (`[ip]:port` for IPv6)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve name {host!r}: {error}") from None
    addresses = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in addresses:
            addresses.append(address)
    return addresses


def read_members(path: str | Path) -> dict[str, list[str]]:
    """The members file: role -> addresses (ValueError if it is not such an object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the members file {path}: {error}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(a, str) for a in v) for v in data.values()
    ):
        raise ValueError(f"the members file {path} must map each role to a list of addresses")
    return data


def write_members(path: str | Path, members: dict[str, list[str]]) -> None:
    """Replaces the members file at once (a reader sees the old one or the new one)."""
    write_atomically(Path(path), json.dumps(members, indent=1) + "\n")


@dataclass
class Change:
    """Who joined and who left a role since the last look."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.joined or self.left)


class Membership:
    """One role's members: the configured entries (DNS names re-resolved) or the members
    file's list for the role, looked at again at most every `refresh_seconds`."""

    def __init__(
        self,
        role: str,
        entries: Sequence[str],
        members_file: str | Path | None = None,
        refresh_seconds: float = 5.0,
        resolve: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role = role
        self.entries = list(entries)
        self.members_file = Path(members_file) if members_file is not None else None
        self.refresh_seconds = refresh_seconds
        self._resolve = resolve
        self._clock = clock
        self.members: list[str] = self._read()
        self._looked_at = clock()

    @classmethod
    def of(cls, role: str, endpoints: EndpointsConfig) -> Membership:
        """`role`'s members as the run's `endpoints` section names them."""
        entries = {
            "rollout-server": endpoints.rollout_servers,
            "reward-server": endpoints.reward_servers,
            "env-server": endpoints.env_servers,
        }[role]
        return cls(role, entries, endpoints.members_file, endpoints.refresh_seconds)

    @property
    def changes_over_time(self) -> bool:
        """Whether the members can change during the run (a DNS name or a members file)."""
        return self.members_file is not None or any(e.startswith(DNS_PREFIX) for e in self.entries)

    def _read(self) -> list[str]:
        entries = self.entries
        if self.members_file is not None and self.members_file.exists():
            listed = read_members(self.members_file)
            if self.role in listed:
                entries = listed[self.role]
        return expand_addresses(entries, self._resolve)

    def due(self) -> bool:
        """Whether the members can change and `refresh_seconds` have passed since the last look."""
        return self.changes_over_time and self._clock() - self._looked_at >= self.refresh_seconds

    def refresh(self, force: bool = False) -> Change:
        """Looks again (when due, or `force`); who joined and who left."""
        if not (self.due() or (force and self.changes_over_time)):
            return Change()
        self._looked_at = self._clock()
        try:
            found = self._read()
        except ValueError as error:
            COUNTERS.inc("members_unreadable", role=self.role)
            log.warning("%ss unchanged: %s", self.role, error)
            return Change()
        change = Change(
            joined=[a for a in found if a not in self.members],
            left=[a for a in self.members if a not in found],
        )
        if change:
            self.members = found
            for address in change.joined:
                COUNTERS.inc("members_joined", role=self.role)
                log.info("%s joined", self.role, extra={"address": address})
            for address in change.left:
                COUNTERS.inc("members_left", role=self.role)
                log.info("%s left", self.role, extra={"address": address})
        return change
