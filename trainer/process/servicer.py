"""The trainer's `rollwire.v1.TrainerService`: status, version, checkpoints on request and
the newest version's weights.

It reads a `TrainerState` the training loop (`rollwire.trainer.process.loop`) keeps up to
date; a checkpoint request is a future the loop resolves after its current step; weights
come from the loop's `WeightStore`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from rollwire.proto.v1 import trainer_pb2, trainer_pb2_grpc

if TYPE_CHECKING:
    from rollwire.trainer.process.weight_sender import Adapters, Deltas, GroupPublisher
    from rollwire.trainer.process.weight_store import WeightStore


class TrainerState:
    """What the TrainerService reports, updated by the loop."""

    def __init__(self) -> None:
        self.step = 0
        self.version = 0
        self.state = "starting"
        self.trained = 0
        self.last_checkpoint = ""
        self.last_metrics: dict[str, float] = {}
        self.checkpoint_requests: list[asyncio.Future[str]] = []
        self.stop_requested = False
        self.stop_requested_at = 0.0
        # Trained since the last checkpoint; the buffer holds them until one commits them.
        self.uncommitted_ids: list[str] = []
        self.resumed_from_step: int | None = None
        # Rank 0 of the weight group (trainer.weights.transport: group), while it holds.
        self.weight_group: GroupPublisher | None = None
        self.deltas: Deltas | None = None
        """`trainer.weights.deltas`: what each rollout-server holds, the last version sent."""
        self.publishing: asyncio.Task[float] | None = None
        """The weights of the last step on their way to the rollout-servers
        (`trainer.weights.overlap_publish`), until the next step waits for them."""
        self.writing: asyncio.Task[str] | None = None
        """A checkpoint being written while the steps go on
        (`trainer.checkpointing.background`), until the next checkpoint waits for it."""
        self.adapters: Adapters | None = None
        """`trainer.weights.adapters`: which rollout-servers hold the LoRA bases."""
        self.store: WeightStore | None = None
        """`trainer.weights.store`: the newest published version, for FetchWeights."""


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """GetStatus, GetVersion, Checkpoint and FetchWeights over the loop's `TrainerState`."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    async def GetStatus(self, request, context) -> trainer_pb2.TrainerStatus:
        s = self.state
        return trainer_pb2.TrainerStatus(
            step=s.step,
            policy_version=s.version,
            state=s.state,
            trained_trajectories=s.trained,
            last_checkpoint=s.last_checkpoint,
            last_metrics=s.last_metrics,
        )

    async def GetVersion(self, request, context) -> trainer_pb2.VersionResponse:
        return trainer_pb2.VersionResponse(policy_version=self.state.version)

    async def Checkpoint(self, request, context) -> trainer_pb2.CheckpointResponse:
        if self.state.state in ("done", "stopping"):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the trainer is stopping; its last checkpoint is in GetStatus",
            )
        future = asyncio.get_running_loop().create_future()
        self.state.checkpoint_requests.append(future)
        try:
            path = await asyncio.wait_for(future, timeout=context.time_remaining() or 600)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the checkpoint is written after the step in progress, and none ended in "
                f"time (trainer state: {self.state.state}); it will still be written",
            )
        return trainer_pb2.CheckpointResponse(
            path=path, step=self.state.step, policy_version=self.state.version
        )

    async def FetchWeights(self, request, context):
        from rollwire.trainer.process.weight_store import VersionGone

        store = self.state.store
        if store is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this trainer keeps no weights to fetch (trainer.weights.store: false)",
            )
        try:
            _, chunks = await store.chunks(request.version)
        except VersionGone as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except LookupError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        for chunk in chunks:
            yield chunk
