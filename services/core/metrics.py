"""Process-wide counters and gauges, and the Prometheus endpoint that serves them.

Counters are tiny: a labelled count with a snapshot, safe across threads. Gauges are
functions read when scraped (queue depths, open sessions, the policy version), each
registered by the service that knows the value. Servers log the counters at shutdown,
and with a `metrics_port` serve both at `http://HOST:PORT/metrics` in Prometheus'
text format (`rollwire_<counter>_total`, `rollwire_<gauge>`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter as _Tally
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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


GaugeValue = float | dict[str, float]
"""A gauge's reading: one number, or one per value of its label."""


class Gauges:
    """Named readings taken when scraped: `register(name, read, help, label)`; `read`
    returns a number, or {label value: number} for a gauge with a label."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, tuple[Callable[[], GaugeValue], str, str | None]] = {}

    def register(
        self, name: str, read: Callable[[], GaugeValue], help: str = "", label: str | None = None
    ) -> None:
        with self._lock:
            self._sources[name] = (read, help, label)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def read(self) -> dict[str, tuple[GaugeValue, str, str | None]]:
        """Every gauge's reading now; one that raises is left out (and logged)."""
        with self._lock:
            sources = dict(self._sources)
        readings = {}
        for name, (read, help, label) in sorted(sources.items()):
            try:
                readings[name] = (read(), help, label)
            except Exception as error:  # a scrape must not fail for one reading
                log.warning("gauge %s could not be read: %s", name, error)
        return readings


GAUGES = Gauges()
"""The gauges of this process."""

_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(name: str) -> str:
    return "rollwire_" + _NOT_A_NAME.sub("_", name)


class _Collector:
    """COUNTERS and GAUGES as Prometheus metric families."""

    def __init__(self, counters: Counters, gauges: Gauges) -> None:
        self.counters = counters
        self.gauges = gauges

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.counters._lock:
            items = sorted(self.counters._tally.items())
        by_name: dict[str, list[tuple[dict[str, str], int]]] = {}
        for (name, labels), count in items:
            by_name.setdefault(name, []).append((dict(labels), count))
        for name, rows in by_name.items():
            keys = sorted({key for labels, _ in rows for key in labels})
            family = CounterMetricFamily(
                _metric_name(name), f"rollwire counter {name}", labels=keys
            )
            for labels, count in rows:
                family.add_metric([labels.get(key, "") for key in keys], count)
            yield family
        for name, (value, help, label) in self.gauges.read().items():
            family = GaugeMetricFamily(
                _metric_name(name),
                help or f"rollwire gauge {name}",
                labels=[label] if label else [],
            )
            if isinstance(value, dict):
                for key, reading in sorted(value.items()):
                    family.add_metric([str(key)], float(reading))
            else:
                family.add_metric([], float(value))
            yield family


class MetricsEndpoint:
    """An HTTP server on its own thread answering `/metrics` from COUNTERS and GAUGES."""

    def __init__(self, host: str, port: int, ready_file: Path | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(COUNTERS, GAUGES))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        bound = self._server.server_address[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.url = f"http://{shown}:{bound}/metrics"
        self.ready_file = ready_file
        if ready_file is not None:
            from rollwire.services.core.files import write_atomically

            write_atomically(ready_file, self.url + "\n")
        log.info("metrics", extra={"url": self.url})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.ready_file is not None and self.ready_file.exists():
            self.ready_file.unlink()


def metrics_ready_file(ready_file: Path | None) -> Path | None:
    """Where a service with `ready_file` writes its metrics URL: beside it, `.metrics`."""
    return None if ready_file is None else ready_file.with_name(ready_file.name + ".metrics")
