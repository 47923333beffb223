"""Services started inside the test process: an engine behind a real rollout-server on
loopback, and a replay buffer served on a thread."""

from __future__ import annotations

import threading
from pathlib import Path

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.services.buffer.client import BufferProducer, BufferTrainerClient
from rollwire.services.buffer.server import BufferServer
from rollwire.services.buffer.state import BufferState
from rollwire.services.buffer.trajectory_log import TrajectoryLog
from rollwire.services.core.server import Registration


async def serve_engine(start_service, engine) -> tuple[str, RolloutServicer]:
    """`engine` behind a RolloutServicer on 127.0.0.1:0 (stopped by `start_service` at
    teardown); returns its address and the servicer."""
    servicer = RolloutServicer(engine)
    runtime = await start_service(
        [
            Registration(
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                servicer,
                "rollwire.v1.RolloutService",
            )
        ]
    )
    return runtime.address, servicer


class Running:
    """A BufferServer on a log folder, served on a thread; `stop()` closes it cleanly."""

    def __init__(self, folder: Path, group_size: int = 2, **log_options) -> None:
        self.state = BufferState(group_size=group_size, max_staleness=5)
        self.log = TrajectoryLog(folder, **log_options)
        self.restored = self.log.restore(self.state, 1 << 20)
        self.state.requeue_unacked()
        self.server = BufferServer(self.state, trajectory_log=self.log)
        self.thread = threading.Thread(target=self.server.serve, kwargs={"poll_ms": 10})
        self.thread.start()
        self.producer = BufferProducer(self.server.endpoints["producer"], timeout=2, attempts=2)
        self.trainer = BufferTrainerClient(self.server.endpoints["trainer"], timeout=2)

    def stop(self) -> None:
        self.producer.close()
        self.trainer.close()
        self.server.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


async def serve_model(start_service, model_path) -> tuple[str, object]:
    """The HF engine on `model_path` (CPU, float32) behind a rollout-server on loopback;
    returns its address and the engine."""
    from rollwire.rollout.server.hf_engine import HFEngine

    engine = HFEngine(model_path, max_batch_size=8)
    address, _ = await serve_engine(start_service, engine)
    return address, engine
