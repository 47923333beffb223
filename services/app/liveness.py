"""Says on the console when a service of a run stops answering, and when it answers again.

A frozen service (stopped, swapped out, stuck in a long call) is survived by the
retries and deadlines of its callers, but nothing in its own process can say so. The
launcher asks each service every few seconds (a gRPC health check; the buffer's status
request) and prints, for one that has not answered for `after_seconds`, its name, for
how long, and what the run is doing meanwhile; then once more when it answers.
Counted in `launcher_unresponsive{service}`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollwire.services.core.metrics import COUNTERS

if TYPE_CHECKING:
    from rollwire.services.core.config import ClientConfig

MEANWHILE = {
    "reward-server": "the orchestrator retries its Score calls and those groups wait",
    "rollout-server": "generation waits and its calls are retried",
    "buffer": "the orchestrator and trainer retry their calls; nothing is lost",
    "trainer": "training waits; the buffer keeps the groups that arrive",
    "env-server": "its episodes wait, and restart on another env-server past their deadline",
}
"""What the rest of a run does while a service of each kind does not answer."""


@dataclass
class Target:
    """One service to ask: its name, kind (the command) and ready-file content."""

    name: str
    kind: str
    address: str


def answers(target: Target, timeout: float, client: ClientConfig | None = None) -> bool:
    """Whether `target` answers a health question within `timeout` seconds, asked with the
    run's `client` settings (TLS, CURVE)."""
    if target.kind == "buffer":
        from rollwire.services.buffer.client import BufferError, BufferTrainerClient

        endpoints = json.loads(target.address)
        buffer = BufferTrainerClient(
            endpoints["trainer"], timeout=timeout, curve=client.curve if client else None
        )
        try:
            buffer.status()
            return True
        except BufferError:
            return False
        finally:
            buffer.close()
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rollwire.services.core.client import channel_credentials

    credentials = channel_credentials(client) if client is not None else None
    with (
        grpc.insecure_channel(target.address)
        if credentials is None
        else grpc.secure_channel(target.address, credentials)
    ) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            return True
        except grpc.RpcError as error:
            # A service that answers at all, even to say it is stopping, is not frozen.
            return error.code() != grpc.StatusCode.DEADLINE_EXCEEDED


class Liveness:
    """A thread that asks every target every `every` seconds and tells `say` about the
    ones that stop answering for `after_seconds` and come back."""

    def __init__(
        self,
        targets: Callable[[], list[Target]],
        say: Callable[[str], None],
        every: float = 5.0,
        after_seconds: float = 10.0,
        timeout: float = 2.0,
        client: ClientConfig | None = None,
    ) -> None:
        self.targets = targets
        self.client = client
        self.say = say
        self.every = every
        self.after_seconds = after_seconds
        self.timeout = timeout
        self._silent_since: dict[str, float] = {}
        self._told: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 2 * self.timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for target in self.targets():
                self.check(target)

    def check(self, target: Target) -> None:
        """Asks `target` once and says what changed."""
        now = time.monotonic()
        if answers(target, self.timeout, self.client):
            since = self._silent_since.pop(target.name, None)
            if target.name in self._told:
                self._told.discard(target.name)
                self.say(f"{target.name} answers again, after {now - since:.0f} s without")
            return
        since = self._silent_since.setdefault(target.name, now - self.timeout)
        if now - since >= self.after_seconds and target.name not in self._told:
            self._told.add(target.name)
            COUNTERS.inc("launcher_unresponsive", service=target.name)
            meanwhile = MEANWHILE.get(target.kind, "its callers retry and wait")
            self.say(
                f"{target.name} ({target.address if target.kind != 'buffer' else 'zmq'}) has "
                f"not answered for {now - since:.0f} s (frozen or overloaded?); meanwhile "
                f"{meanwhile}"
            )
