"""The trainer process: take a batch, step, publish weights, acknowledge, repeat.

    rollwire trainer -c run.yaml

The loop below is the whole of training; everything else is set-up. Weights go out
through `rollwire.trainer.process.weight_sender`; the TrainerService that reports on the
loop is `rollwire.trainer.process.servicer`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc.aio

from rollwire.proto.v1 import rollout_pb2, trainer_pb2_grpc
from rollwire.services.buffer.client import BufferError, BufferTrainerClient
from rollwire.services.core.client import describe_error
from rollwire.services.core.config import RunConfig
from rollwire.services.core.files import latest_checkpoint, remove_unfinished_checkpoints
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, call_with_retries
from rollwire.services.core.server import Registration, ServiceRuntime
from rollwire.services.core.telemetry import dump_tasks_on_signal
from rollwire.services.core.timing import PhaseClock
from rollwire.services.core.watchdog import Watchdog
from rollwire.services.core.wire import Batch
from rollwire.trainer.learner import seed_initialisation, torchrun_argv
from rollwire.trainer.pipelines.table import load, pipeline_of
from rollwire.trainer.process.records import Clock, MetricsLog, open_trained_log
from rollwire.trainer.process.servicer import TrainerServicer, TrainerState
from rollwire.trainer.process.thread_plan import ThreadPlan
from rollwire.trainer.process.weight_sender import (
    Adapters,
    Deltas,
    RolloutPeers,
    catch_up,
    form_weight_group,
    publish,
    served_versions,
)
from rollwire.trainer.process.weight_store import WeightStore
from rollwire.trainer.rl.policy import Policy

log = logging.getLogger(__name__)


def policy_of(config: RunConfig, model_path: Path) -> Policy:
    """The policy of `config`'s pipeline (`pipeline_of`): its model family and its step."""
    from rollwire.trainer.models import family_for

    pipeline = pipeline_of(config)
    family = family_for(pipeline.family, model_path, config)
    return Policy(model_path, config.trainer, config.rl, family, load(pipeline.step))


async def resume(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    peers: RolloutPeers,
    buffer: BufferTrainerClient,
) -> None:
    """Puts the trainer where its newest checkpoint left it, and the buffer and the
    rollout-servers in step with it. A fresh run goes through here too: it finds no
    checkpoint and a buffer with nothing served.

    Versions only grow (ARCHITECTURE.md, invariant 6): a trainer restarted from step k
    after the servers saw version j > k publishes its checkpoint's weights as
    version j + 1, so policy versions run ahead of steps from then on.
    """
    run_dir = Path(config.run.output_dir)
    for staging in remove_unfinished_checkpoints(run_dir):
        log.warning("removed a checkpoint left half-written", extra={"path": str(staging)})
    folder = latest_checkpoint(run_dir) if config.trainer.checkpointing.resume else None
    committed: list[str] = []
    if folder is not None:
        saved = await asyncio.to_thread(policy.restore, folder)
        state.step, state.version = int(saved["step"]), int(saved["policy_version"])
        committed = list(saved.get("uncommitted_ids", []))
        state.last_checkpoint = str(folder)
        state.resumed_from_step = state.step
    seen = [state.version, *await served_versions(peers.stubs())]
    status = await _buffer_call(
        buffer.status, "status", config.trainer.batch_timeout_seconds, state
    )
    seen.append(status.trainer_version)
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
    await catch_up(
        peers.stubs(), policy, state.version, config.trainer.weights.chunk_bytes, state.deltas
    )
    if state.store is not None:
        await asyncio.to_thread(state.store.put, policy.named_weights(), state.version, True)
    if folder is not None or counts.requeued_groups:
        log.info(
            "resumed",
            extra={
                "checkpoint": str(folder) if folder else None,
                "step": state.step,
                "policy_version": state.version,
                "committed_groups": counts.committed_groups,
                "requeued_groups": counts.requeued_groups,
            },
        )


async def train(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    peers: RolloutPeers,
    buffer: BufferTrainerClient,
) -> None:
    """Steps until rl.max_steps or a stop, checkpointing as configured and at the end."""
    trainer = config.trainer
    run_dir = Path(config.run.output_dir)
    metrics_log = MetricsLog(run_dir, config)
    trained_log = open_trained_log(run_dir, state)
    watchdog, watch_seconds = Watchdog("trainer"), config.telemetry.watchdog_seconds
    watchdog.start()
    clock = Clock()
    phases = PhaseClock()
    plan = None
    if config.run.cpu_threads:
        sync = config.rl.mode == "sync"
        plan = ThreadPlan.start(config.run.cpu_threads, sync, len(peers.stubs()))
        await follow_plan(plan, policy, peers.stubs())  # whatever threads they started with
    try:
        while state.step < config.rl.max_steps and not state.stop_requested:
            state.state = "waiting_for_batch"
            waited_from = time.perf_counter()
            with watchdog.watch("batch wait", f"for step {state.step + 1}", watch_seconds):
                batch = await _wait_for_batch(config, policy, state, peers, buffer)
            if batch is None:
                break
            clock.idle += time.perf_counter() - waited_from
            phases.add("wait", time.perf_counter() - waited_from)
            with watchdog.watch("step", f"{state.step + 1}", watch_seconds):
                await _step(config, policy, state, peers, buffer, batch, trained_log, phases)
            metrics = state.last_metrics
            due = trainer.checkpointing.every and state.step % trainer.checkpointing.every == 0
            if due or state.checkpoint_requests:
                with phases.phase("checkpoint"):
                    await checkpoint(
                        policy,
                        state,
                        run_dir,
                        buffer,
                        trainer.batch_timeout_seconds,
                        background=trainer.checkpointing.background,
                    )
            # The step's breakdown: waiting, the model's phases (`train_step` timed them),
            # publishing, acknowledging, checkpointing; and the CPU the process used.
            metrics.update(phases.take())
            if plan is not None:
                waited, wall = metrics.get("time_wait_seconds", 0.0), metrics["wall_seconds"]
                if plan.observe(waited, wall):
                    await follow_plan(plan, policy, peers.stubs())
                metrics["threads_trainer"], metrics["threads_rollout"] = plan.trainer, plan.rollout
            metrics.update(clock.rates(state))
            metrics_log.write(state.step, metrics)
        await finish_publishing(state)  # the last version reaches the rollout-servers
        await checkpoint(policy, state, run_dir, buffer, trainer.batch_timeout_seconds)
    finally:
        if state.publishing is not None:
            state.publishing.cancel()
        if state.writing is not None and not state.writing.done():
            # Stopped on an error: let the write end (or fail) on its own; the folder
            # appears whole or not at all.
            await asyncio.wait([state.writing], timeout=trainer.batch_timeout_seconds)
        watchdog.stop()
        metrics_log.close()
        trained_log.close()
        state.state = "done"


async def _wait_for_batch(
    config: RunConfig,
    policy: Policy,
    state: TrainerState,
    peers: RolloutPeers,
    buffer: BufferTrainerClient,
) -> Batch | None:
    """The next batch; meanwhile brings restarted and joining rollout-servers up to date. None when
    a stop was asked for; TimeoutError past trainer.batch_timeout_seconds."""
    trainer = config.trainer
    waited_from = time.perf_counter()
    last_catch_up = 0.0
    while not state.stop_requested:
        sending = state.publishing is not None and not state.publishing.done()
        if state.version and not sending and time.monotonic() - last_catch_up > 2.0:
            last_catch_up = time.monotonic()
            await peers.refresh()
            await catch_up(
                peers.stubs(), policy, state.version, trainer.weights.chunk_bytes, state.deltas
            )
        await asyncio.to_thread(policy.heartbeat)
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
    peers: RolloutPeers,
    buffer: BufferTrainerClient,
    batch: Batch,
    trained_log: Any,
    phases: PhaseClock,
) -> None:
    """Trains on `batch`, publishes the new weights, writes the record, acknowledges it
    (the last two timed on `phases`).

    With periodic checkpoints the buffer keeps the batch until the next one
    commits it; without, it is let go now.
    """
    trainer = config.trainer
    commit_now = trainer.checkpointing.every == 0
    state.state = "training"
    # In ordinal order: the same groups give the same step whatever order they came in.
    trajectories = sorted(batch.trajectories, key=lambda t: (t.prompt_ordinal, t.sample_index))
    metrics = await asyncio.to_thread(policy.train_step, trajectories, state.version)
    state.version += 1
    state.step += 1
    state.state = "publishing"
    with phases.phase("publish"):
        # Versions go out in order: the last one sent in the background first.
        metrics.update(await finish_publishing(state))
        overlap = trainer.weights.overlap_publish and config.rl.staleness > 0
        if overlap:
            named = await asyncio.to_thread(policy.weights_snapshot)
        else:  # the weights as they are (None: publish reads them itself)
            named = policy.named_weights() if state.store is not None else None
        sending = publish(
            peers.stubs(),
            policy,
            state.version,
            trainer.weights.chunk_bytes,
            group=state.weight_group,
            named=named,
            deltas=state.deltas,
            adapters=state.adapters,
        )
        # The store's copy is taken beside the sending, before the next step changes the
        # weights (a snapshot is kept as it is: nothing changes it).
        storing = (
            asyncio.to_thread(state.store.put, named, state.version, not overlap)
            if state.store is not None and named is not None
            else asyncio.sleep(0)
        )
        if overlap:  # sent while this step is acknowledged and the next batch awaited
            state.publishing = asyncio.create_task(sending, name=f"publish-{state.version}")
            await storing
        else:
            await asyncio.gather(sending, storing)
    metrics["weights_by_group"] = float(
        state.weight_group is not None and state.weight_group.usable
    )
    sent = state.deltas or state.adapters
    if sent is not None:  # the last publish that finished (with overlap: the one before)
        metrics["publish_bytes"] = float(sent.bytes_sent)
        metrics["publish_bytes_whole"] = float(sent.bytes_whole)
    trained_ids = [t.trajectory_id for t in trajectories]
    record = {
        "step": state.step,
        "batch_id": batch.batch_id,
        "ids": trained_ids,
        "ordinals": sorted({t.prompt_ordinal for t in trajectories}),
    }
    trained_log.write(json.dumps(record) + "\n")
    trained_log.flush()
    with phases.phase("ack"):
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


async def finish_publishing(state: TrainerState) -> dict[str, float]:
    """Waits for the weights being sent in the background, if any (raising what sending
    them raised); their seconds, as `publish_overlapped_seconds`."""
    task, state.publishing = state.publishing, None
    if task is None:
        return {}
    return {"publish_overlapped_seconds": await task}


async def follow_plan(plan: ThreadPlan, policy: Policy, rollout_stubs: list[Any]) -> None:
    """Gives the trainer and the rollout-servers the plan's threads. A trainer that cannot
    change its threads at run time fixes the plan where it is; rollout-servers that cannot
    keep theirs, and the trainer moves alone (`ThreadPlan.rollout_fixed`). Logged once."""
    reason = policy.set_threads(plan.trainer)
    if reason is not None:
        plan.fixed = f"trainer: {reason}"
        log.warning("the thread plan stays as it is: %s", plan.fixed)
        return
    if plan.rollout_fixed is None:  # once they said they cannot, they are not asked again
        reasons = await _give_rollout_threads(plan.per_server(len(rollout_stubs)), rollout_stubs)
        if reasons:
            plan.rollout_fixed = "; ".join(reasons)
            log.warning(
                "generation keeps the threads it started with (%s); the trainer takes "
                "threads beside it while it is behind",
                plan.rollout_fixed,
            )
    log.info("threads moved", extra={"trainer": plan.trainer, "rollout": plan.rollout})


async def _give_rollout_threads(threads: int, rollout_stubs: list[Any]) -> list[str]:
    """Asks each rollout-server to compute with `threads`; why those that cannot, did not."""
    reasons = []
    request = rollout_pb2.SetThreadsRequest(threads=threads)
    for stub in rollout_stubs:
        try:
            reply = await stub.SetThreads(request, timeout=10.0)
        except grpc.aio.AioRpcError as error:
            log.warning(
                "a rollout-server did not take its threads", extra={"error": describe_error(error)}
            )
            continue
        if not reply.applied:
            reasons.append(f"rollout-server: {reply.reason}")
    return reasons


STOP_PATIENCE_SECONDS = 10.0


async def _buffer_call(
    call: Any, what: str, patience: float, state: TrainerState | None = None
) -> Any:
    """Runs a blocking buffer call, retrying while the buffer does not answer (it may be
    restarting: it rebuilds from its log) for up to `patience` seconds, and for no more
    than 10 s once a stop was asked for (SIGTERM must not wait out a dead buffer). A
    request the buffer refused is raised at once: sending it again changes nothing."""

    def stop_deadline() -> float | None:
        if state is not None and state.stop_requested:
            return state.stop_requested_at + STOP_PATIENCE_SECONDS
        return None

    def count(error: BaseException, attempt: int) -> None:
        COUNTERS.inc("trainer_buffer_retries", call=what)
        log.warning("buffer did not answer; retrying", extra={"call": what, "error": str(error)})

    return await call_with_retries(
        functools.partial(asyncio.to_thread, call),
        # Every half second, as long as the patience lasts.
        RetryPolicy(attempts=None, first_pause=0.5, multiplier=1.0, total_seconds=patience),
        what=f"buffer {what}",
        retryable=lambda error: isinstance(error, BufferError) and "refused" not in str(error),
        on_retry=count,
        deadline=stop_deadline,
    )


async def checkpoint(
    policy: Policy,
    state: TrainerState,
    run_dir: Path,
    buffer: BufferTrainerClient | None = None,
    patience: float = 60.0,
    *,
    background: bool = False,
) -> str:
    """Writes a checkpoint (atomically), then lets the buffer go of what it holds.

    The ids trained since the last checkpoint are saved in it: a trainer that dies
    between writing it and the buffer's commit sends them again when it resumes.

    `background`: the weights and optimizer state are copied now and written while the
    next steps run (`Policy.checkpoint_writer`); the commit, the log line and the
    answers to checkpoint requests wait for the write, and the next checkpoint (or the
    end) waits for this one. Returns the folder's path either way (in the background,
    before it exists). A sharded backend writes before returning.
    """
    if state.writing is not None:
        await state.writing  # one checkpoint at a time, in order
        state.writing = None
    state.state = "checkpointing"
    step = state.step
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    uncommitted = list(state.uncommitted_ids)
    # The requests made until now are answered by this checkpoint; later ones by the next.
    requests, state.checkpoint_requests = state.checkpoint_requests, []
    done = Written(step, uncommitted, requests, time.perf_counter())
    extra = {"uncommitted_ids": uncommitted}
    writer = None
    if background:
        writer = await asyncio.to_thread(
            policy.checkpoint_writer, folder, step, state.version, extra
        )
    if writer is None:
        path = await asyncio.to_thread(policy.save_checkpoint, folder, step, state.version, extra)
        return await done.settle(str(path), state, buffer, patience, background=False)
    state.writing = asyncio.create_task(
        _write_in_background(writer, done, state, buffer, patience), name=f"checkpoint {step}"
    )
    return str(folder)


async def _write_in_background(
    writer: Callable[[], Path],
    done: Written,
    state: TrainerState,
    buffer: BufferTrainerClient | None,
    patience: float,
) -> str:
    try:
        path = str(await asyncio.to_thread(writer))
    except Exception as error:
        # Nothing is committed: the buffer keeps the batches, a restart trains them again.
        COUNTERS.inc("trainer_checkpoint_failures")
        log.error("checkpoint not written", extra={"step": done.step, "error": repr(error)})
        for request in done.requests:
            if not request.done():
                request.set_exception(error)
        raise
    return await done.settle(path, state, buffer, patience, background=True)


@dataclass
class Written:
    """What follows a checkpoint once its folder is in place: the batches it holds to
    commit, the requests it answers."""

    step: int
    uncommitted: list[str]
    requests: list[asyncio.Future[str]]
    started: float

    async def settle(
        self,
        path: str,
        state: TrainerState,
        buffer: BufferTrainerClient | None,
        patience: float,
        *,
        background: bool,
    ) -> str:
        """The buffer commits the batches the checkpoint holds; its requests are answered."""
        state.last_checkpoint = path
        log.info(
            "checkpoint written",
            extra={
                "path": path,
                "step": self.step,
                "seconds": round(time.perf_counter() - self.started, 3),
                "background": background,
            },
        )
        if buffer is not None and self.uncommitted:
            commit = functools.partial(buffer.commit, self.uncommitted)
            await _buffer_call(commit, "commit", patience, state)
            del state.uncommitted_ids[: len(self.uncommitted)]
        for request in self.requests:
            if not request.done():
                request.set_result(path)
        return path


async def run(config: RunConfig, model_path: Path) -> int:
    """Serves the TrainerService, waits for the rollout-servers, resumes and trains."""
    endpoints = config.endpoints
    if endpoints.buffer_trainer is None or not endpoints.rollout_servers:
        raise ValueError("the trainer needs endpoints.buffer_trainer and endpoints.rollout_servers")
    state = TrainerState()
    if config.trainer.weights.deltas:  # streams only (the config refuses it with a group)
        state.deltas = Deltas()
    if config.trainer.weights.adapters:  # a LoRA run's (the config checks)
        state.adapters = Adapters()
    if config.trainer.weights.store:
        state.store = WeightStore(config.trainer.weights.chunk_bytes)
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
    peers = RolloutPeers(config)
    # A short timeout: a request lost with a restarting buffer is re-sent soon.
    buffer = BufferTrainerClient(
        endpoints.buffer_trainer,
        timeout=5.0,
        curve=config.client.curve,
        token=config.buffer.trainer_token(),
    )
    try:
        await peers.wait_until_serving()
        seed_initialisation(config.run.seed)
        policy = await asyncio.to_thread(policy_of, config, model_path)
        loop = asyncio.get_running_loop()

        def request_stop() -> None:
            state.stop_requested = True
            state.stop_requested_at = time.monotonic()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, request_stop)
        dump_tasks_on_signal(loop, "trainer")
        if state.adapters is not None:  # a model whose adapters cannot go alone says so now
            await asyncio.to_thread(policy.named_adapters)
        await resume(config, policy, state, peers, buffer)
        if config.trainer.weights.transport == "group":
            state.weight_group = await form_weight_group(config, policy, peers.stubs())
        try:
            await train(config, policy, state, peers, buffer)
        finally:
            if state.weight_group is not None:
                state.weight_group.close()
            await asyncio.to_thread(policy.close)
        log.info("training finished", extra={"steps": state.step, "policy_version": state.version})
        return 0
    finally:
        buffer.close()
        await peers.close()
        await runtime.stop(grace=1)


def follow(config: RunConfig, model_path: Path) -> int:
    """A trainer rank other than 0: holds its part of the model and does what rank 0
    asks (steps, checkpoints, gathers) until rank 0 says stop. SIGTERM is left to rank
    0, which finishes with a checkpoint these ranks must write their parts of."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: log.info("stop asked; rank 0 decides when"))
    seed_initialisation(config.run.seed)
    policy_of(config, model_path).followed()
    return 0


def run_trainer(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire trainer`: train until rl.max_steps (or SIGTERM), checkpoint, exit 0.

    With trainer.world_size above 1 and no torchrun around it, the process becomes
    torchrun over `argv` (the command's own arguments), same pid: each rank comes back
    here, rank 0 to train, the others to follow it.
    """
    from rollwire.services.core.telemetry import configure_logging
    from rollwire.services.core.tiny import default_model_path

    if config.trainer.world_size > 1 and "WORLD_SIZE" not in os.environ:
        command = torchrun_argv(config, list(sys.argv[2:] if argv is None else argv))
        if "ROLLWIRE_LAUNCHER_PID" in os.environ:
            # The ranks are torchrun's children: they end when it does (it keeps this
            # process's tie to the launcher across the exec).
            os.environ["ROLLWIRE_LAUNCHER_PID"] = str(os.getpid())
        # A rank that dies of a signal (an abort in a collective library) prints where.
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        sys.stdout.flush()
        os.execv(command[0], command)
    rank = int(os.environ.get("RANK", "0"))
    name = "trainer" if rank == 0 else f"trainer-rank{rank}"
    configure_logging(name, config.telemetry.log_level, config.telemetry.log_format)
    if config.trainer.world_size > 1:
        log.info(
            "rank %d of %s on %s (node rank %s)",
            rank,
            os.environ.get("WORLD_SIZE"),
            socket.gethostname(),
            os.environ.get("GROUP_RANK", "0"),
        )
    if config.trainer.model_path is not None:
        model_path = Path(config.trainer.model_path)
    elif config.rollout_server.engine == "diffusion":
        from rollwire.diffusion.digits import digits_model

        model_path = digits_model(threads=config.trainer.threads)
    else:
        model_path = Path(default_model_path())
    try:
        if rank != 0:
            return follow(config, model_path)
        return asyncio.run(run(config, model_path))
    except (OSError, ValueError, TimeoutError, BufferError, grpc.aio.AioRpcError) as error:
        log.error("trainer stopped: %s", describe_error(error))
        return 1
