"""The in-flight table every engine keeps its requests in (`rollout/server/requests.py`)."""

from __future__ import annotations

import pytest

from rollwire.rollout.server.engine import RequestError
from rollwire.rollout.server.requests import InFlight


def test_a_request_is_held_for_its_block_and_a_duplicate_id_is_refused() -> None:
    stopped: list[list[str]] = []
    table: InFlight[str] = InFlight(stopped.append)
    made: list[str] = []
    with table.hold("a", lambda: "request a") as request:
        assert request == "request a" and "a" in table and table.get("a") == request
        with (
            pytest.raises(RequestError, match="request id 'a' is already in flight"),
            table.hold("a", lambda: made.append("second") or "second"),
        ):
            pass
        assert made == []  # refused before the second request was made
        with pytest.raises(ValueError), table.hold("b", lambda: "request b"):
            raise ValueError("the generation failed")
        assert len(table) == 1 and table.get("b") is None  # let go however the block ended
        assert table.abort(["a", "unknown"]) == 1
        assert table.abort(all_requests=True) == 1
    assert len(table) == 0 and table.abort(all_requests=True) == 0
    assert stopped == [["request a"], ["request a"], []]  # stop hears every abort
