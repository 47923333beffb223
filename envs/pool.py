"""Several env-servers behind one chooser: sessions spread by load, sticky, lost servers left out.

The orchestrator asks the pool for a backend when an episode starts and keeps
the episode on it (a session lives on one server). It reports a backend lost
when a call raises `EnvServerLost`; the pool then leaves that backend out of
new episodes for `retry_after_seconds` and tries it again afterwards, so a
restarted server rejoins on its own. The episode itself is restarted
elsewhere, from the same seed, by the caller.

Addresses are `host:port`, or `dns:///name:port` for every address the name
resolves to (a compose service scaled with `--scale`, a Kubernetes headless
service). The members can change during the run (`rollwire.services.core.members`):
a server that joins gets new episodes at once; one that leaves gets none, and is
closed once its running episodes end (an episode whose server is gone restarts
elsewhere, as for a lost one).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rollwire.envs.base import EnvSpec
from rollwire.envs.client import EnvBackend, EnvServerLost, LocalEnvs, RemoteEnvs
from rollwire.services.core.config import ClientConfig, EndpointsConfig, EnvServerConfig
from rollwire.services.core.members import Membership
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)


class EnvPool:
    """Backends to start episodes on: the least busy healthy one, lost ones rested."""

    def __init__(
        self,
        backends: Sequence[EnvBackend],
        retry_after_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        membership: Membership | None = None,
        connect: Callable[[str], EnvBackend] | None = None,
    ) -> None:
        if not backends:
            raise ValueError("an env pool needs at least one backend")
        self.backends = list(backends)
        self.membership = membership
        """Where the env-servers come from when they can change; `connect` makes a
        backend of a joining one."""
        self._connect = connect
        self._leaving: list[EnvBackend] = []
        """Backends whose server left: no new episodes, closed when their last ends."""
        self.retry_after_seconds = retry_after_seconds
        self._clock = clock
        self._active = {id(b): 0 for b in self.backends}
        self._down_until = {id(b): 0.0 for b in self.backends}
        self._order = itertools.count()
        self._last_pick = {id(b): -1 for b in self.backends}
        self.lost_count = 0

    @classmethod
    def from_config(
        cls,
        endpoints: EndpointsConfig,
        client: ClientConfig,
        env_server: EnvServerConfig,
    ) -> EnvPool:
        """Remote backends for the run's env-servers (which may change during the run), or
        in-process environments when there are none."""
        membership = Membership.of("env-server", endpoints)
        if not membership.members:
            return cls([LocalEnvs(env_server)])

        def connect(address: str) -> EnvBackend:
            return RemoteEnvs(address, client)

        backends = [connect(address) for address in membership.members]
        return cls(backends, membership=membership, connect=connect)

    def refresh(self) -> None:
        """Takes in the env-servers that joined and lets go of those that left."""
        if self.membership is None or self._connect is None:
            return
        change = self.membership.refresh()
        for address in change.joined:
            backend = self._connect(address)
            self.backends.append(backend)
            self._active[id(backend)] = 0
            self._down_until[id(backend)] = 0.0
            self._last_pick[id(backend)] = -1
        for address in change.left:
            for backend in [b for b in self.backends if b.address == address]:
                if len(self.backends) == 1:
                    log.warning("the last env-server left; it stays in use until another joins")
                    continue
                self.backends.remove(backend)
                self._leaving.append(backend)

    async def close_left(self) -> None:
        """Closes the backends of servers that left, once their episodes have ended."""
        for backend in [b for b in self._leaving if self._active[id(b)] == 0]:
            self._leaving.remove(backend)
            await backend.aclose()

    def healthy(self) -> list[EnvBackend]:
        now = self._clock()
        return [b for b in self.backends if self._down_until[id(b)] <= now]

    def pick(self) -> EnvBackend:
        """The healthy backend with the fewest running episodes (the longest unused on ties).

        When every backend is resting, the one whose rest ends first: trying it
        is better than stalling, and the caller bounds the attempts.
        """
        self.refresh()
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
        for backend in self.backends + self._leaving:
            await backend.aclose()
