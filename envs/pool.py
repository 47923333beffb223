"""Several env-servers behind one chooser: sessions spread by load, sticky, lost servers left out.

The orchestrator asks the pool for a backend when an episode starts and keeps
the episode on it (a session lives on one server). It reports a backend lost
when a call raises `EnvServerLost`; the pool then leaves that backend out of
new episodes for `retry_after_seconds` and tries it again afterwards, so a
restarted server rejoins on its own. The episode itself is restarted
elsewhere, from the same seed, by the caller.

Addresses are `host:port`, or `dns:///name:port` for every address the name
resolves to (a Kubernetes headless service, say), resolved when the pool is
built.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rollwire.envs.base import EnvSpec
from rollwire.envs.client import EnvBackend, EnvServerLost, LocalEnvs, RemoteEnvs
from rollwire.services.core.config import ClientConfig, EnvServerConfig
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)


def expand_addresses(
    addresses: Sequence[str],
    resolve: Callable[[str, int], list[str]] | None = None,
) -> list[str]:
    """`host:port` entries as they are; each `dns:///name:port` as every address it resolves to."""
    resolve = resolve or _resolve
    expanded: list[str] = []
    for address in addresses:
        if not address.startswith("dns:///"):
            expanded.append(address)
            continue
        target = address.removeprefix("dns:///")
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"env-server address {address!r} must look like dns:///name:port")
        found = resolve(host, int(port))
        if not found:
            raise ValueError(f"{address!r} resolves to no address")
        expanded.extend(a for a in found if a not in expanded)
    return expanded


def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve env-server name {host!r}: {error}") from None
    addresses = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in addresses:
            addresses.append(address)
    return addresses


class EnvPool:
    """Backends to start episodes on: the least busy healthy one, lost ones rested."""

    def __init__(
        self,
        backends: Sequence[EnvBackend],
        retry_after_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not backends:
            raise ValueError("an env pool needs at least one backend")
        self.backends = list(backends)
        self.retry_after_seconds = retry_after_seconds
        self._clock = clock
        self._active = {id(b): 0 for b in self.backends}
        self._down_until = {id(b): 0.0 for b in self.backends}
        self._order = itertools.count()
        self._last_pick = {id(b): -1 for b in self.backends}
        self.lost_count = 0

    @classmethod
    def from_config(
        cls, addresses: Sequence[str], client: ClientConfig, env_server: EnvServerConfig
    ) -> EnvPool:
        """Remote backends for `addresses`, or in-process environments when there are none."""
        if not addresses:
            return cls([LocalEnvs(env_server)])
        return cls([RemoteEnvs(address, client) for address in expand_addresses(addresses)])

    def healthy(self) -> list[EnvBackend]:
        now = self._clock()
        return [b for b in self.backends if self._down_until[id(b)] <= now]

    def pick(self) -> EnvBackend:
        """The healthy backend with the fewest running episodes (the longest unused on ties).

        When every backend is resting, the one whose rest ends first: trying it
        is better than stalling, and the caller bounds the attempts.
        """
        candidates = self.healthy()
        if not candidates:
            return min(self.backends, key=lambda b: self._down_until[id(b)])
        return min(candidates, key=lambda b: (self._active[id(b)], self._last_pick[id(b)]))

    @contextmanager
    def lease(self, backend: EnvBackend) -> Iterator[EnvBackend]:
        """Counts an episode as running on `backend` while the block runs."""
        self._active[id(backend)] += 1
        self._last_pick[id(backend)] = next(self._order)
        try:
            yield backend
        finally:
            self._active[id(backend)] -= 1

    def active(self, backend: EnvBackend) -> int:
        return self._active[id(backend)]

    def report_lost(self, backend: EnvBackend, error: EnvServerLost) -> None:
        """Leaves `backend` out of new episodes for a while."""
        already_down = self._down_until[id(backend)] > self._clock()
        self._down_until[id(backend)] = self._clock() + self.retry_after_seconds
        if not already_down:
            self.lost_count += 1
            COUNTERS.inc("env_servers_lost", address=backend.address)
            log.warning(
                "env-server lost; its episodes restart elsewhere",
                extra={"address": backend.address, "error": str(error)},
            )

    async def specs(self) -> dict[str, EnvSpec]:
        """The environments on offer, asked of the first backend that answers."""
        last: Exception | None = None
        for backend in self.healthy() or self.backends:
            try:
                return {spec.env_id: spec for spec in await backend.list_envs()}
            except EnvServerLost as error:
                self.report_lost(backend, error)
                last = error
        raise EnvServerLost(f"no env-server answered ListEnvs: {last}")

    async def aclose(self) -> None:
        for backend in self.backends:
            await backend.aclose()
