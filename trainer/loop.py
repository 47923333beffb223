"""The trainer process: take a batch, step, publish weights, acknowledge, repeat.

    rollwire trainer -c run.yaml

The loop below is the whole of training; everything else is set-up and the
TrainerService that reports on it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import grpc.aio

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from rollwire.rollout.weight_group import WeightGroupError
from rollwire.rollout.weights import iter_weight_chunks
from rollwire.services.buffer.client import BufferError, BufferTrainerClient
from rollwire.services.core.client import describe_error, open_channel, wait_for_serving
from rollwire.services.core.config import RunConfig
from rollwire.services.core.files import latest_checkpoint
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import Registration, ServiceRuntime
from rollwire.services.core.telemetry import dump_tasks_on_signal
from rollwire.services.core.watchdog import Watchdog
from rollwire.services.core.wire import Batch
from rollwire.trainer.model import Policy
from rollwire.trainer.weight_sender import GroupPublisher

log = logging.getLogger(__name__)


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
        # Rank 0 of the weight group (trainer.weight_transport: group), while it holds.
        self.weight_group: GroupPublisher | None = None


class MetricsLog:
    """Metrics as JSON lines and, when tensorboard is installed, TensorBoard events."""

    def __init__(self, run_dir: Path) -> None:
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics" / "trainer.jsonl").open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            log.warning("tensorboard is not installed; metrics go to JSON lines only")
            self._board = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in metrics.items():
                self._board.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def publish(
    stubs: list[Any],
    policy: Policy,
    version: int,
    chunk_bytes: int,
    timeout: float = 120.0,
    group: GroupPublisher | None = None,
) -> float:
    """Sends the weights to every rollout-server at once; returns the seconds it took.

    By broadcast in the weight group when there is one (`trainer.weight_transport:
    group`); if that fails the group is dropped for good and the servers behind get
    the version as gRPC streams. A server that cannot be reached (restarting) is
    skipped and counted; `catch_up` brings it to the current version once it is back.
    """
    started = time.perf_counter()
    named = policy.named_weights()
    if group is not None and group.usable:
        try:
            await group.publish(stubs, named, version)
            return time.perf_counter() - started
        except WeightGroupError as error:
            COUNTERS.inc("weight_group_failures")
            log.warning("weights go as gRPC streams from now on: %s", error)
            await catch_up(stubs, policy, version, chunk_bytes)
            return time.perf_counter() - started
    replies = await asyncio.gather(
        *(
            stub.UpdateWeights(iter_weight_chunks(named, version, chunk_bytes), timeout=timeout)
            for stub in stubs
        ),
        return_exceptions=True,
    )
    for reply in replies:
        if isinstance(reply, grpc.aio.AioRpcError) and reply.code() in _UNREACHABLE:
            COUNTERS.inc("trainer_publish_missed")
            log.warning("a rollout-server missed version %d: %s", version, describe_error(reply))
        elif isinstance(reply, BaseException):
            raise reply
        elif reply.version != version:
            raise RuntimeError(f"a rollout-server took version {reply.version}, not {version}")
    return time.perf_counter() - started


async def catch_up(stubs: list[Any], policy: Policy, version: int, chunk_bytes: int) -> int:
    """Sends the weights to every reachable rollout-server behind `version` (one that was
    restarted starts from the initial weights); returns how many were behind."""
    behind = []
    for stub in stubs:
        try:
            status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            continue  # not back yet: the next round asks again
        if status.policy_version < version:
            behind.append(stub)
    if behind:
        COUNTERS.inc("trainer_catch_ups", amount=len(behind))
        log.info("rollout-servers behind version %d: sending it", version)
        await publish(behind, policy, version, chunk_bytes)
    return len(behind)


async def resume(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    rollout_stubs: list[Any],
    buffer: BufferTrainerClient,
) -> None:
    """Puts the trainer where its newest checkpoint left it, and the buffer and the
    rollout-servers in step with it. A fresh run goes through here too: it finds no
    checkpoint and a buffer with nothing served.

    Versions only grow (DESIGN.md, invariant 6): a trainer restarted from step k
    after the servers saw version j > k publishes its checkpoint's weights as
    version j + 1, so policy versions run ahead of steps from then on.
    """
    run_dir = Path(config.run.output_dir)
    folder = latest_checkpoint(run_dir) if config.trainer.resume else None
    committed: list[str] = []
    if folder is not None:
        saved = await asyncio.to_thread(policy.restore, folder)
        state.step, state.version = int(saved["step"]), int(saved["policy_version"])
        committed = list(saved.get("uncommitted_ids", []))
        state.last_checkpoint = str(folder)
        state.resumed_from_step = state.step
    seen = [state.version]
    for stub in rollout_stubs:
        try:
            status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=5.0)
            seen.append(status.policy_version)
        except grpc.aio.AioRpcError:
            pass  # not up: it gets the weights when it is (catch_up)
    status = await _buffer_call(
        buffer.status, "status", config.trainer.batch_timeout_seconds, state
    )
    seen.append(int(status["trainer_version"]))
    if max(seen) > state.version:
        state.version = max(seen) + 1
    counts = await _buffer_call(
        functools.partial(buffer.resume, committed, state.version, state.step),
        "resume",
        config.trainer.batch_timeout_seconds,
        state,
    )
    # A server at the checkpoint's version holds its very weights (a version is never
    # reused); the others get them now.
    await catch_up(rollout_stubs, policy, state.version, config.trainer.weight_chunk_bytes)
    if folder is not None or counts.get("requeued_groups"):
        log.info(
            "resumed",
            extra={
                "checkpoint": str(folder) if folder else None,
                "step": state.step,
                "policy_version": state.version,
                **counts,
            },
        )


async def train(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    rollout_stubs: list[Any],
    buffer: BufferTrainerClient,
) -> None:
    trainer = config.trainer
    run_dir = Path(config.run.output_dir)
    metrics_log = MetricsLog(run_dir)
    # What was trained, batch by batch: the record exactly-once accounting checks. A
    # restart from a checkpoint is written down too: the steps after it happen again.
    trained_path = run_dir / "metrics" / "trained_ids.jsonl"
    restarted = trained_path.exists() and trained_path.stat().st_size > 0
    trained_log = trained_path.open("a")
    if restarted:  # a trainer before this one wrote here: its steps after ours are undone
        trained_log.write(
            json.dumps({"resumed_from_step": state.step, "policy_version": state.version}) + "\n"
        )
        trained_log.flush()
    watchdog, watch_seconds = Watchdog("trainer"), config.telemetry.watchdog_seconds
    watchdog.start()
    clock = _Clock()
    try:
        while state.step < config.rl.max_steps and not state.stop_requested:
            state.state = "waiting_for_batch"
            waited_from = time.perf_counter()
            with watchdog.watch("batch wait", f"for step {state.step + 1}", watch_seconds):
                batch = await _wait_for_batch(config, policy, state, rollout_stubs, buffer)
            if batch is None:
                break
            clock.idle += time.perf_counter() - waited_from
            with watchdog.watch("step", f"{state.step + 1}", watch_seconds):
                await _step(config, policy, state, rollout_stubs, buffer, batch, trained_log)
            metrics = state.last_metrics
            metrics.update(clock.rates(state))
            metrics_log.write(state.step, metrics)
            due = trainer.checkpoint_every and state.step % trainer.checkpoint_every == 0
            if due or state.checkpoint_requests:
                await checkpoint(policy, state, run_dir, buffer, trainer.batch_timeout_seconds)
        await checkpoint(policy, state, run_dir, buffer, trainer.batch_timeout_seconds)
    finally:
        watchdog.stop()
        metrics_log.close()
        trained_log.close()
        state.state = "done"


class _Clock:
    """Wall time of this trainer and the part of it spent waiting for batches."""

    def __init__(self) -> None:
        self.started, self.idle = time.perf_counter(), 0.0

    def rates(self, state: TrainerState) -> dict[str, float]:
        elapsed = time.perf_counter() - self.started
        return {
            "policy_version": float(state.version),
            "trainer_idle_fraction": self.idle / elapsed,
            "trajectories_per_second": state.trained / elapsed,
            "elapsed_seconds": elapsed,
        }


async def _wait_for_batch(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    rollout_stubs: list[Any],
    buffer: BufferTrainerClient,
) -> Batch | None:
    """The next batch; meanwhile brings restarted rollout-servers up to date. None when
    a stop was asked for; TimeoutError past trainer.batch_timeout_seconds."""
    trainer = config.trainer
    waited_from = time.perf_counter()
    last_catch_up = 0.0
    while not state.stop_requested:
        if state.version and time.monotonic() - last_catch_up > 2.0:
            last_catch_up = time.monotonic()
            await catch_up(rollout_stubs, policy, state.version, trainer.weight_chunk_bytes)
        batch = await _buffer_call(
            functools.partial(
                buffer.get_batch, state.version, config.rl.groups_per_step, 1.0, state.step
            ),
            "get",
            trainer.batch_timeout_seconds,
            state,
        )
        if batch is not None:
            return batch
        if time.perf_counter() - waited_from > trainer.batch_timeout_seconds:
            raise TimeoutError(
                f"no batch for {trainer.batch_timeout_seconds:g}s at version {state.version}: "
                "check that the orchestrator runs and that rl.group_size matches its groups"
            )
    return None


async def _step(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    rollout_stubs: list[Any],
    buffer: BufferTrainerClient,
    batch: Batch,
    trained_log: Any,
) -> None:
    """Trains on `batch`, publishes the new weights, writes the record, acknowledges it.

    With periodic checkpoints the buffer keeps the batch until the next one
    commits it; without, it is let go now.
    """
    trainer = config.trainer
    commit_now = trainer.checkpoint_every == 0
    state.state = "training"
    # In ordinal order: the same groups give the same step whatever order they came in.
    trajectories = sorted(batch.trajectories, key=lambda t: (t.prompt_ordinal, t.sample_index))
    metrics = await asyncio.to_thread(policy.train_step, trajectories, state.version)
    state.version += 1
    state.step += 1
    state.state = "publishing"
    metrics["publish_seconds"] = await publish(
        rollout_stubs, policy, state.version, trainer.weight_chunk_bytes, group=state.weight_group
    )
    metrics["weights_by_group"] = float(
        state.weight_group is not None and state.weight_group.usable
    )
    trained_ids = [t.trajectory_id for t in trajectories]
    record = {
        "step": state.step,
        "batch_id": batch.batch_id,
        "ids": trained_ids,
        "ordinals": sorted({t.prompt_ordinal for t in trajectories}),
    }
    trained_log.write(json.dumps(record) + "\n")
    trained_log.flush()
    await _buffer_call(
        functools.partial(
            buffer.ack, batch.batch_id, state.version, trained_ids, commit_now, state.step
        ),
        "ack",
        trainer.batch_timeout_seconds,
        state,
    )
    if not commit_now:
        state.uncommitted_ids.extend(trained_ids)
    state.trained += len(trajectories)
    state.last_metrics = metrics


STOP_PATIENCE_SECONDS = 10.0


async def _buffer_call(
    call: Any, what: str, patience: float, state: TrainerState | None = None
) -> Any:
    """Runs a blocking buffer call, retrying while the buffer does not answer (it may be
    restarting: it rebuilds from its log) for up to `patience` seconds, and for no more
    than 10 s once a stop was asked for (SIGTERM must not wait out a dead buffer)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await asyncio.to_thread(call)
        except BufferError as error:
            if state is not None and state.stop_requested:
                deadline = min(deadline, state.stop_requested_at + STOP_PATIENCE_SECONDS)
            if "refused" in str(error) or time.monotonic() > deadline:
                raise
            COUNTERS.inc("trainer_buffer_retries", call=what)
            log.warning(
                "buffer did not answer; retrying", extra={"call": what, "error": str(error)}
            )
            await asyncio.sleep(0.5)


async def checkpoint(
    policy: Policy,
    state: TrainerState,
    run_dir: Path,
    buffer: BufferTrainerClient | None = None,
    patience: float = 60.0,
) -> str:
    """Writes a checkpoint (atomically), then lets the buffer go of what it holds.

    The ids trained since the last checkpoint are saved in it: a trainer that dies
    between writing it and the buffer's commit sends them again when it resumes.
    """
    state.state = "checkpointing"
    folder = run_dir / "checkpoints" / f"step_{state.step:06d}"
    uncommitted = list(state.uncommitted_ids)
    path = str(
        await asyncio.to_thread(
            policy.save_checkpoint,
            folder,
            state.step,
            state.version,
            {"uncommitted_ids": uncommitted},
        )
    )
    state.last_checkpoint = path
    log.info("checkpoint written", extra={"path": path, "step": state.step})
    if buffer is not None and uncommitted:
        await _buffer_call(functools.partial(buffer.commit, uncommitted), "commit", patience, state)
        del state.uncommitted_ids[: len(uncommitted)]
    for request in state.checkpoint_requests:
        if not request.done():
            request.set_result(path)
    state.checkpoint_requests.clear()
    return path


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
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


async def run(config: RunConfig, model_path: Path) -> int:
    endpoints = config.endpoints
    if endpoints.buffer_trainer is None or not endpoints.rollout_servers:
        raise ValueError("the trainer needs endpoints.buffer_trainer and endpoints.rollout_servers")
    state = TrainerState()
    runtime = ServiceRuntime("trainer", config.trainer.server)
    await runtime.start(
        [
            Registration(
                trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                TrainerServicer(state),
                "rollwire.v1.TrainerService",
            )
        ]
    )
    channels = [open_channel(address, config.client) for address in endpoints.rollout_servers]
    # A short timeout: a request lost with a restarting buffer is re-sent soon.
    buffer = BufferTrainerClient(endpoints.buffer_trainer, timeout=5.0, curve=config.client.curve)
    try:
        for address, channel in zip(endpoints.rollout_servers, channels, strict=True):
            await wait_for_serving(
                channel, timeout=config.client.connect_timeout_seconds, target=address
            )
        policy = await asyncio.to_thread(Policy, model_path, config.trainer, config.rl)
        stubs = [rollout_pb2_grpc.RolloutServiceStub(channel) for channel in channels]
        loop = asyncio.get_running_loop()

        def request_stop() -> None:
            state.stop_requested = True
            state.stop_requested_at = time.monotonic()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, request_stop)
        dump_tasks_on_signal(loop, "trainer")
        await resume(config, policy, state, stubs, buffer)
        if config.trainer.weight_transport == "group":
            state.weight_group = await form_weight_group(config, policy, stubs)
        try:
            await train(config, policy, state, stubs, buffer)
        finally:
            if state.weight_group is not None:
                state.weight_group.close()
        log.info("training finished", extra={"steps": state.step, "policy_version": state.version})
        return 0
    finally:
        buffer.close()
        for channel in channels:
            await channel.close()
        await runtime.stop(grace=1)


async def form_weight_group(
    config: RunConfig, policy: Policy, stubs: list[Any]
) -> GroupPublisher | None:
    """The weight group of this trainer and every rollout-server, or None (weights then go
    as gRPC streams) when it does not form."""
    trainer = config.trainer
    try:
        return await GroupPublisher.form(
            stubs,
            trainer.weight_group_address,
            trainer.weight_group_backend,
            trainer.weight_group_timeout_seconds,
            device=trainer.device,
        )
    except WeightGroupError as error:
        COUNTERS.inc("weight_group_failures")
        log.warning("no weight group, weights go as gRPC streams: %s", error)
        return None


def run_trainer(config: RunConfig) -> int:
    """`rollwire trainer`: train until rl.max_steps (or SIGTERM), checkpoint, exit 0."""
    from rollwire.services.core.telemetry import configure_logging
    from rollwire.services.core.tiny import default_model_path

    configure_logging("trainer", config.telemetry.log_level, config.telemetry.log_format)
    model_path = config.trainer.model_path or default_model_path()
    try:
        return asyncio.run(run(config, Path(model_path)))
    except (OSError, ValueError, TimeoutError, BufferError, grpc.aio.AioRpcError) as error:
        log.error("trainer stopped: %s", describe_error(error))
        return 1
