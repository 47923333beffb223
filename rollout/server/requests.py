"""The requests an engine has in flight, by request id: the bookkeeping every engine shares.

An engine holds each request for as long as its `generate` runs (`InFlight.hold`), which
refuses an id already in flight, and aborts requests by id or all at once
(`InFlight.abort`). What a request is while it runs, and how one is stopped, is the
engine's own: a flag its decoding loop reads, a queue to the thread that owns the model, a
call on the event loop it generates on, a connection closed. The engine passes that in as
`stop`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from rollwire.rollout.server.engine import RequestError

Request = TypeVar("Request")


class InFlight(Generic[Request]):
    """An engine's requests in flight by request id, and how to stop some of them."""

    def __init__(self, stop: Callable[[list[Request]], None]) -> None:
        """`stop` ends the given requests early (their tokens so far come back with the
        finish reason "abort"); `abort` calls it on every abort, with no requests too."""
        self._requests: dict[str, Request] = {}
        self._stop = stop

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        """The request in flight under `request_id`, or None."""
        return self._requests.get(request_id)

    def values(self) -> list[Request]:
        """Every request in flight, as a list of its own (the table may change meanwhile)."""
        return list(self._requests.values())

    @contextlib.contextmanager
    def hold(self, request_id: str, make: Callable[[], Request]) -> Iterator[Request]:
        """Keeps the request `make` builds in flight under `request_id` for the length of
        the with-block, however it ends. RequestError, before `make` is called, if that id
        is already in flight."""
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        request = self._requests[request_id] = make()
        try:
            yield request
        finally:
            self._requests.pop(request_id, None)

    def abort(self, request_ids: Iterable[str] = (), all_requests: bool = False) -> int:
        """Stops the named requests that are in flight (unknown ids are skipped), or every
        one with `all_requests`; returns how many it stopped."""
        targets = (
            list(self._requests.values())
            if all_requests
            else [self._requests[r] for r in request_ids if r in self._requests]
        )
        self._stop(targets)
        return len(targets)
