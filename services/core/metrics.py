"""Process-wide counters: how many calls, errors and rejected inputs a service saw.

Deliberately tiny: a labelled counter with a snapshot, safe across threads.
Servers expose the snapshot in their logs at shutdown and through status calls;
an exporter can read the same registry later.
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally


class Counters:
    """Named counters with string labels, e.g. rpc_errors{method=..., code=...}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tally: _Tally[tuple[str, tuple[tuple[str, str], ...]]] = _Tally()

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._tally[key] += amount

    def get(self, name: str, **labels: str) -> int:
        """The count for exactly these labels; with no labels, the total over all."""
        with self._lock:
            if labels:
                return self._tally[(name, tuple(sorted(labels.items())))]
            return sum(count for (counter, _), count in self._tally.items() if counter == name)

    def snapshot(self) -> dict[str, int]:
        """Every counter as `name{label=value,...}` -> count."""
        with self._lock:
            items = list(self._tally.items())
        out = {}
        for (name, labels), count in sorted(items):
            suffix = ",".join(f"{k}={v}" for k, v in labels)
            out[f"{name}{{{suffix}}}" if suffix else name] = count
        return out


COUNTERS = Counters()
"""The registry shared by everything in this process."""
