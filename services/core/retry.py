"""One way to try a call again: attempts, back-off, what counts as retryable, a total deadline.

Every caller that retries — the orchestrator's gRPC calls, its puts to a full
buffer, its evaluations, the trainer's buffer calls, the buffer producer's
re-sends — goes through `call_with_retries`, so every loop has the same shape,
each retry is seen by the caller's `on_retry` (which counts it) and none waits
without bound.

A call is retried when `retryable(error)` says so and the policy allows one
more attempt before its deadline; otherwise the last error is raised as it
was. The pause before attempt n is `first_pause * multiplier**(n - 2)`, capped
at `max_pause`, and never runs past the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TryAgain(Exception):
    """Raised by a call to ask for another attempt without it being an error (a full
    buffer, say); `reason` is counted and logged."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to try."""

    attempts: int | None = 5
    """Attempts in all (the first included); None: as many as the deadline allows."""
    first_pause: float = 0.25
    """Seconds before the second attempt."""
    multiplier: float = 2.0
    """Each pause is this many times the one before."""
    max_pause: float = 4.0
    """No pause is longer than this."""
    total_seconds: float | None = None
    """No attempt starts later than this many seconds after the first; None: no bound
    but the attempt count (one of the two must be set)."""

    def __post_init__(self) -> None:
        if self.attempts is None and self.total_seconds is None:
            raise ValueError("a retry policy needs attempts or total_seconds (or both)")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    def pause(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.first_pause * self.multiplier ** (attempt - 1), self.max_pause)


def always(_: BaseException) -> bool:
    return True


def grpc_codes(*names: str) -> Callable[[BaseException], bool]:
    """A `retryable` test for gRPC errors whose status code is one of `names`
    (e.g. "UNAVAILABLE", "DEADLINE_EXCEEDED"); anything else is not retried."""
    wanted = frozenset(names)

    def retryable(error: BaseException) -> bool:
        code = getattr(error, "code", None)
        if not callable(code):
            return False
        try:
            return code().name in wanted
        except (AttributeError, TypeError):
            return False

    return retryable


async def call_with_retries(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    what: str,
    retryable: Callable[[BaseException], bool] = always,
    on_retry: Callable[[BaseException, int], None] | None = None,
    deadline: Callable[[], float | None] | None = None,
) -> T:
    """Awaits `call()` until it returns, retrying as `policy` allows.

    `what` names the call in logs and errors; `on_retry(error, attempt)` runs before
    each pause (to count it). `deadline`, when given, is asked
    before each retry for a monotonic time past which no attempt starts (it may
    move closer while the call is retried: a stop was asked for, say); it
    narrows the policy's own `total_seconds`. A `TryAgain` the policy no longer
    allows becomes a TimeoutError naming its reason."""
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as error:
            again = isinstance(error, TryAgain)
            if not again and not retryable(error):
                raise
            pause = policy.pause(attempt)
            limit = _limit(policy, started, deadline)
            out_of_attempts = policy.attempts is not None and attempt >= policy.attempts
            if out_of_attempts or (limit is not None and time.monotonic() + pause > limit):
                if again:
                    raise TimeoutError(
                        f"{what} did not go through in {time.monotonic() - started:.3g}s "
                        f"({attempt} attempts): {error}"
                    ) from None
                raise
            if on_retry is not None:
                on_retry(error, attempt)
            log.debug("retrying", extra={"call": what, "attempt": attempt, "error": str(error)})
            await asyncio.sleep(pause)


def _limit(
    policy: RetryPolicy, started: float, deadline: Callable[[], float | None] | None
) -> float | None:
    limits = [started + policy.total_seconds] if policy.total_seconds is not None else []
    moving = deadline() if deadline is not None else None
    if moving is not None:
        limits.append(moving)
    return min(limits) if limits else None
