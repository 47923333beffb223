"""Structured logs and tracing set-up shared by every service.

Logs are one JSON object per line on stderr, carrying the service name and, when
a span is active, its trace and span ids, so a log line can be joined with the
trace of the call that wrote it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace

# Attributes every LogRecord has; anything else was passed through `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, service, logger, msg, trace ids, extras."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """A line for people: time, level, service, message, then extras as key=value."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(
            f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and not k.startswith("_")
        )
        line = f"{stamp} {record.levelname:<7} {self.service}: {record.getMessage()}"
        if extras:
            line += f"  {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(service: str, level: str = "info", fmt: str = "json") -> None:
    """Routes every logger of this process to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
"""The standard variables naming an OTLP collector; either turns OTLP export on."""


def configure_tracing(service: str, exporter: str = "none") -> trace.TracerProvider | None:
    """Installs a tracer provider for this process when spans should be exported.

    `otlp` sends them over OTLP/gRPC to the collector the standard variables name
    (`OTEL_EXPORTER_OTLP_ENDPOINT`, e.g. `http://collector:4317`); `none` with one of
    those variables set means `otlp` too. With `none` and no variable nothing is
    installed: spans are not recorded, but trace context is still propagated through
    calls so other services can join it.
    """
    import os

    if exporter == "none" and any(os.environ.get(name) for name in OTLP_VARIABLES):
        exporter = "otlp"
    if exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        raise ValueError(f"unknown trace exporter {exporter!r}")
    trace.set_tracer_provider(provider)
    return provider


def dump_tasks_on_signal(loop: Any, service: str) -> None:
    """On SIGUSR1, logs the stack of every asyncio task of `loop` (where is it waiting?)."""
    import io
    import signal

    def dump() -> None:
        out = io.StringIO()
        for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
            out.write(f"--- task {task.get_name()}\n")
            task.print_stack(limit=25, file=out)
        logging.getLogger(__name__).warning(
            "asyncio tasks of %s on SIGUSR1:\n%s", service, out.getvalue()
        )

    loop.add_signal_handler(signal.SIGUSR1, dump)
