"""Traces over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set: one trace per group across the
orchestrator, rollout-server, reward- or env-server and buffer, checked with a receiver that
records what it is sent."""

from __future__ import annotations

from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.helpers.runs import GUESS_RUN, rollwire


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps (trace id, service, span name) of every span."""

    def __init__(self) -> None:
        self.spans: list[tuple[bytes, str, str]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope in resource_spans.scope_spans:
                self.spans += [(span.trace_id, service, span.name) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def traces(self) -> dict[bytes, set[str]]:
        """trace id -> the services that sent spans of it."""
        services: dict[bytes, set[str]] = defaultdict(set)
        for trace_id, service, _ in self.spans:
            services[trace_id].add(service)
        return services


@pytest.fixture
def collector(monkeypatch):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "500")  # ms between batches
    yield receiver
    server.stop(grace=None)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_groups_trace_spans_every_service_it_went_through(collector, tmp_path) -> None:
    rollwire(tmp_path, "train", f"run.output_dir={tmp_path / 'run'}", "rl.max_steps=2",
             "warmup.steps=0", "orchestrator.eval_dataset=null", timeout=300)  # fmt: skip
    single = {
        frozenset(services)
        for services in collector.traces().values()
        if "orchestrator" in services
    }
    wanted = {"orchestrator", "rollout-server", "reward-server", "buffer"}
    assert any(wanted <= services for services in single), single
    names = {(service, name) for _, service, name in collector.spans}
    assert ("orchestrator", "group") in names and ("buffer", "buffer put") in names
    assert ("reward-server", "rollwire.v1.RewardService/Score") in names, sorted(names)

    collector.spans.clear()
    rollwire(tmp_path, "train", f"run.output_dir={tmp_path / 'agentic'}", *GUESS_RUN,
             "rl.max_steps=2", "warmup.steps=0", "orchestrator.eval_dataset=null",
             timeout=300)  # fmt: skip
    agentic = [s for s in collector.traces().values() if "orchestrator" in s]
    assert any({"orchestrator", "rollout-server", "env-server", "buffer"} <= s for s in agentic)
