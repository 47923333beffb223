"""The orchestrator: prompts in, scored trajectories out to the buffer.

For each task it samples `rl.group_size` responses from the rollout-servers
(or plays as many episodes against the env-servers), scores them on a
reward-server and sends each as a trajectory to the buffer. It launches a
group only while

    groups launched < (trainer version + staleness bound + 1) * groups per step

so it never produces what the buffer would have to throw away; with a bound
of 0 generation waits for each step (the synchronous mode). It evaluates the
policy on held-out prompts every `eval_every` versions, greedily.

Start here; the rest of the room:

    pacing.py      which prompt next, how many groups may be in play, dynamic
                   sampling, waiting on a full buffer
    sampler.py     answers of the served model, scored (what evaluation and
                   distillation data use alone, without a buffer)
    servers.py     the calls to the rollout- and reward-servers, retried
    teacher.py     on-policy distillation's teacher scoring each group
    episode.py     an episode's tokens and the trajectory made of them
    agent.py       multi-turn episodes against env-servers
    images.py      groups of images from a diffusion rollout-server, and their evaluation
    evaluation.py  held-out evaluation
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc.aio
from opentelemetry import propagate, trace

from rollwire.rollout.orchestrator.episode import (
    EpisodeTokens,
    finish_reason_of,
    trajectory_from_episode,
)
from rollwire.rollout.orchestrator.evaluation import Evaluation
from rollwire.rollout.orchestrator.images import (
    ImageEvaluation,
    image_group,
    sample_seeds,
    sampling_of,
)
from rollwire.rollout.orchestrator.pacing import (
    DynamicSampling,
    PromptQueue,
    launch_capacity,
    put_group_with_backpressure,
)
from rollwire.rollout.orchestrator.sampler import Sampler
from rollwire.rollout.orchestrator.teacher import Teacher
from rollwire.services.buffer.client import BufferError, BufferProducer
from rollwire.services.buffer.protocol import PutAnswer
from rollwire.services.core.client import describe_error
from rollwire.services.core.config import EnvDataset, ImageDataset, RunConfig, scored_domains
from rollwire.services.core.datasets import Task, cycle, load_tasks, task_at, training_tasks
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.server import EXIT_NO_RESTART
from rollwire.services.core.watchdog import Watchdog
from rollwire.services.core.wire import Trajectory

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("rollwire.orchestrator")


class GroupsKeepFailing(RuntimeError):
    """Every recent group failed: the run stops rather than retry prompts forever."""


SESSION_CLOSE_SECONDS = 10.0
"""How long a stopping orchestrator waits for its cancelled episodes to close their sessions."""


class Orchestrator:
    """Feeds the buffer with scored groups, as fast as the trainer and the staleness
    bound allow (see the module's docstring)."""

    def __init__(self, config: RunConfig, tokenizer: Any) -> None:
        self.config = config
        self.rl = config.rl
        self.settings = config.orchestrator
        self.tokenizer = tokenizer
        self.trainer_version = 0
        self.trainer_step = 0
        self.launched = 0
        self.resumed_gaps = 0
        self.completed = 0
        self.failed = 0
        self.failed_in_a_row = 0
        """Groups given up since the last one that finished."""
        self.filtered = 0
        self.dynamic_sampling = DynamicSampling(
            self.settings.filter_uniform_groups, self.settings.max_replacements_per_step
        )
        self.generated_tokens = 0
        self.dropped_groups = 0
        self.held_out_excluded = 0
        self.running: dict[asyncio.Task[bool], Task] = {}
        self.group_failures: dict[int, int] = {}  # prompt ordinal -> its groups that failed
        self.started = self.last_report = time.perf_counter()
        self.watchdog = Watchdog("orchestrator")
        self.watch_seconds = config.telemetry.watchdog_seconds
        self.sampler = Sampler(config, tokenizer)
        """Generation and scoring (and, with an env dataset, episodes): the groups' makings."""
        self.teacher: Teacher | None = None
        """On-policy distillation's teacher, once `connect` has found it (a training run's
        only: evaluations and distillation data do without)."""
        endpoints = config.endpoints
        self.producer = BufferProducer(endpoints.buffer_producer, curve=config.client.curve)
        self.run_dir = Path(config.run.output_dir)
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.eval_log = (self.run_dir / "metrics" / "eval.jsonl").open("a")
        self.progress_log = (self.run_dir / "metrics" / "orchestrator.jsonl").open("a")
        self.agentic = self.sampler.agentic
        self.images = isinstance(self.settings.dataset, ImageDataset)
        """An image run: groups come from a diffusion rollout-server (`images.py`)."""
        reward_fl = config.reward_fl
        self.image_sampling = sampling_of(
            self.settings.images, grad_steps=reward_fl.grad_steps if reward_fl.enabled else None
        )
        """How an image run's training samples are drawn (Flow-GRPO's or RewardFL's)."""
        self.generated_images = 0

    async def run(self) -> None:
        """Feeds the buffer until the trainer reaches `rl.max_steps`. Each pass evaluates
        the policy when due, launches the groups the staleness bound allows and reaps
        those that finished."""
        await self.connect()
        self.watchdog.start()
        dataset = training_tasks(
            self.settings.dataset, self.settings.eval_dataset, self.config.run.seed
        )
        if dataset.excluded:
            log.info(
                "training prompts that are in the evaluation set are left out",
                extra={"excluded": dataset.excluded, "kept": len(dataset)},
            )
        self.held_out_excluded = dataset.excluded
        if not self.images:  # an image prompt is the task's question, no template
            self.check_prompts(dataset, "orchestrator.dataset")
        self.sampler.servers.check_domains(
            scored_domains(self.settings.dataset) | scored_domains(self.settings.eval_dataset)
        )
        again, start = await self.resume_point(dataset)
        prompts = PromptQueue(again, cycle(dataset, start))
        evaluation = self.held_out_evaluation()
        await self.refresh_version()
        self.started = self.last_report = time.perf_counter()
        try:
            while True:
                await evaluation.when_due(self.trainer_version, self.trainer_step)
                if self.trainer_step >= self.rl.max_steps:
                    break
                capacity = self.launch(prompts)
                await self.reap(prompts)
                # Acks carry the trainer version; ask the buffer only when that is all we wait for.
                if self.launched >= capacity or not self.running:
                    await self.refresh_version()
                self.report_now_and_then()
        finally:
            for pending in self.running:
                pending.cancel()
            if self.running:
                # Cancelled episodes close their env sessions on the way out; wait for that
                # (bounded) before the connections close, or the sessions stay open on the
                # servers until they expire.
                await asyncio.wait(list(self.running), timeout=SESSION_CLOSE_SECONDS)
            self._report()  # also when stopped by a signal

    # ------------------------------------------------------------ the steps of a run

    async def connect(self) -> None:
        """Waits until every rollout- and reward-server serves; with an env dataset, asks
        the env-servers what they offer."""
        await self.sampler.servers.wait_until_serving()
        if self.config.trainer.algorithm.advantage.type == "on_policy_distill":
            self.teacher = Teacher(self.config)
            await self.teacher.connect(self.sampler.servers.rollout_stubs())
        if self.agentic:
            await self.sampler.start_episodes()

    def check_prompts(self, tasks: Sequence[Task], what: str, first: int = 64) -> None:
        """Renders the prompt of the first tasks (each part of a mixture among them), so a
        template naming a field the data lacks stops the run here, not group by group."""
        if self.agentic:  # an env writes its own first observation
            return
        for index in range(min(first, len(tasks))):
            try:
                task_at(tasks, index).prompt(self.settings.prompt_template)
            except ValueError as error:
                raise ValueError(
                    f"{what}: {error}; set orchestrator.prompt_template (a file dataset's "
                    "prompt is `{question}`)"
                ) from None

    async def resume_point(self, tasks: Sequence[Task]) -> tuple[list[Task], int]:
        """Where a (re)started orchestrator begins: the prompts the buffer's ledger shows
        unfinished and not held (a group lost with the previous orchestrator, or only
        part of it arrived), then the first ordinal never seen. Sets `launched` to the
        groups already in play, so the run does not produce more than it needs."""
        ledger = await self.producer.ledger()
        frontier, highest = ledger.frontier, ledger.highest
        finished, whole = set(ledger.above), set(ledger.whole)
        gaps = [o for o in range(frontier, highest + 1) if o not in finished and o not in whole]
        given_up = ledger.outcomes.get("filtered", 0) + ledger.outcomes.get("failed", 0)
        self.launched = highest + 1 - given_up - len(gaps)
        self.resumed_gaps = len(gaps)
        if highest >= 0:
            log.info(
                "resuming from the buffer's ledger",
                extra={"frontier": frontier, "next": highest + 1, "gaps": len(gaps)},
            )
        return [task_at(tasks, o) for o in gaps], highest + 1

    def held_out_evaluation(self) -> Evaluation:
        """The evaluation of this run (of no tasks when `eval_dataset` is unset)."""
        tasks = load_tasks(self.settings.eval_dataset) if self.settings.eval_dataset else []
        common = {
            "every": self.settings.eval_every,
            "final_step": self.rl.max_steps,
            "concurrency": self.settings.max_concurrent_groups * self.rl.group_size,
            "log_file": self.eval_log,
            "watchdog": self.watchdog,
            "watch_seconds": self.watch_seconds,
        }
        if self.images:
            return ImageEvaluation(
                list(tasks), self.sampler.servers, self.settings.images, self.run_dir, **common
            )
        self.check_prompts(tasks, "orchestrator.eval_dataset")
        return Evaluation(tasks, self.sampler.greedy_reward, **common)

    async def refresh_version(self) -> None:
        """Asks the buffer for the trainer's version and step and the groups it dropped as
        too stale."""
        status = await self.producer.status()
        self.trainer_version = max(self.trainer_version, status.trainer_version)
        # A trainer restarted from a checkpoint goes back to its step.
        self.trainer_step = status.trainer_step
        self.dropped_groups = status.outcomes.get("stale", 0)

    def launch(self, prompts: PromptQueue) -> int:
        """Launches groups while the staleness bound and `max_concurrent_groups` allow;
        returns the bound (the groups that may have been launched by now)."""
        capacity = launch_capacity(
            self.trainer_step,
            self.rl.staleness,
            self.rl.groups_per_step,
            self.rl.max_steps,
            self.dropped_groups,
        )
        while self.launched < capacity and len(self.running) < self.settings.max_concurrent_groups:
            task = prompts.next()
            self.running[asyncio.ensure_future(self.run_group(task))] = task
            self.launched += 1
        return capacity

    async def reap(self, prompts: PromptQueue) -> None:
        """Waits a moment for running groups to finish and counts those that did."""
        if not self.running:
            await asyncio.sleep(0.05)
            return
        done, _ = await asyncio.wait(
            self.running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
        )
        for finished in done:
            task = self.running.pop(finished)
            if finished.exception() is not None:
                self.launched -= 1  # the group never reached the buffer: make room for another
                await self._group_failed(task, finished.exception(), prompts)
            elif finished.result() is False:
                self.filtered += 1
                self.launched -= 1  # dropped by dynamic sampling: another prompt replaces it
            else:
                self.completed += 1
                self.failed_in_a_row = 0

    async def _group_failed(self, task: Task, error: BaseException, prompts: PromptQueue) -> None:
        """A group that failed is run again (first, before new prompts) up to
        `request_attempts` times; then its ordinal is given up, and the buffer told."""
        self.failed += 1
        COUNTERS.inc("orchestrator_failed_groups")
        failures = self.group_failures[task.ordinal] = self.group_failures.get(task.ordinal, 0) + 1
        if failures < self.settings.request_attempts:
            log.warning("group failed; running it again: %s", error)
            prompts.run_again(task)
            return
        log.error("group failed %d times; giving it up: %s", failures, error)
        try:
            await self.producer.drop(task.ordinal, task.task_id, "failed")
        except BufferError as lost:  # the ledger keeps it a gap: a restart runs it again
            log.error("could not tell the buffer: %s", lost)
        self.failed_in_a_row += 1
        limit = self.settings.max_failed_groups_in_a_row
        if limit and self.failed_in_a_row >= limit:
            raise GroupsKeepFailing(
                f"{self.failed_in_a_row} groups in a row were given up and none finished "
                f"(orchestrator.max_failed_groups_in_a_row); the last one's error: {error}"
            )

    # ------------------------------------------------------------ one group

    async def run_group(self, task: Task) -> bool:
        """Samples, scores and sends one group; False when it was filtered out."""
        what = f"ordinal {task.ordinal} ({task.task_id})"
        attributes = {
            "rollwire.ordinal": task.ordinal,
            "rollwire.task_id": task.task_id,
            "rollwire.domain": task.domain,
        }
        # One trace per group: its generation, env and scoring calls, and the buffer's puts.
        # The span comes first: the watchdog then names its trace, rather than making an
        # unsampled one of its own that the group's spans would inherit.
        with (
            _TRACER.start_as_current_span("group", attributes=attributes),
            self.watchdog.watch("group", what, self.watch_seconds),
        ):
            if self.agentic:
                trajectories = await self.play_env_group(task)
            elif self.images:
                trajectories = await self.image_group(task)
            else:
                trajectories = await self.sample_group(task)
            if self.teacher is not None:
                started = time.perf_counter()
                await self.teacher.score(trajectories)
                for trajectory in trajectories:
                    trajectory.timings["teacher"] = time.perf_counter() - started
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            for trajectory in trajectories:
                trajectory.trace_context = dict(carrier)
            return await self.send_group(trajectories)

    async def sample_group(self, task: Task) -> list[Trajectory]:
        """`rl.group_size` responses to one prompt, scored, as trajectories."""
        answers = await self.sampler.answers(task, task.ordinal)
        outputs = answers.outputs
        timings = {"generate": answers.generate_seconds, "score": answers.score_seconds}
        trajectories = []
        for index, (output, result) in enumerate(zip(outputs, answers.scores, strict=True)):
            tokens = EpisodeTokens()
            tokens.context(answers.prompt_ids, answers.images)
            tokens.generated(output, turn=0)
            trajectory = trajectory_from_episode(
                task,
                index,
                tokens,
                reward=result.reward,
                reward_components=dict(result.components),
                finish_reason=finish_reason_of(output),
                timings=dict(timings),
            )
            trajectories.append(trajectory)
        self.generated_tokens += sum(len(o.token_ids) for o in outputs)
        return trajectories

    async def image_group(self, task: Task) -> list[Trajectory]:
        """`rl.group_size` images of one prompt, scored, as latent trajectories; a group
        that lost a sample (a rollout-server stopping) fails, to be run again."""
        seeds = sample_seeds(
            self.sampler.servers.sampling_base, int(task.metadata["image_seed"]), self.rl.group_size
        )
        trajectories = await image_group(
            self.sampler.servers, task, task.ordinal, self.image_sampling, seeds
        )
        if len(trajectories) < len(seeds):
            raise RuntimeError(f"{len(seeds) - len(trajectories)} images of the group were aborted")
        self.generated_images += len(trajectories)
        return trajectories

    async def play_env_group(self, task: Task) -> list[Trajectory]:
        """`rl.group_size` episodes from one seed, each on its own."""
        episodes = await asyncio.gather(
            *(
                self.sampler.episodes.run(task, index, self.rl.temperature)
                for index in range(self.rl.group_size)
            )
        )
        self.generated_tokens += sum(int(t.loss_mask.sum()) for t in episodes)
        return list(episodes)

    async def send_group(self, trajectories: list[Trajectory]) -> bool:
        """Puts a finished group into the buffer; False when dynamic sampling dropped it."""
        if self.dynamic_sampling.drops([t.reward for t in trajectories], self.trainer_version):
            first = trajectories[0]
            await self.producer.drop(first.prompt_ordinal, first.group_id, "filtered")
            return False
        with self.sampler.servers.clock.phase("buffer_put"):
            answers = await put_group_with_backpressure(
                self.producer, trajectories, self.config.trainer.batch_timeout_seconds
            )
        for trajectory, answer in zip(trajectories, answers, strict=True):
            self._note_answer(trajectory, answer)
        return True

    def _note_answer(self, trajectory: Trajectory, answer: PutAnswer) -> None:
        self.trainer_version = max(self.trainer_version, answer.trainer_version)
        if not answer.accepted:
            COUNTERS.inc("orchestrator_refused", reason=answer.reason)
            log.warning(
                "buffer refused a trajectory",
                extra={"trajectory_id": trajectory.trajectory_id, "reason": answer.reason},
            )

    # ------------------------------------------------------------ reports and closing

    def report_now_and_then(self) -> None:
        """Writes a progress report every 5 seconds."""
        if time.perf_counter() - self.last_report > 5:
            self.last_report = time.perf_counter()
            self._report()

    def _report(self) -> None:
        elapsed = time.perf_counter() - self.started
        entry = {
            "time": time.time(),
            "trainer_version": self.trainer_version,
            "groups_completed": self.completed,
            "groups_failed": self.failed,
            "groups_filtered": self.filtered,
            "groups_resumed": self.resumed_gaps,
            "held_out_excluded": self.held_out_excluded,
            "generated_tokens": self.generated_tokens,
            **({"generated_images": self.generated_images} if self.images else {}),
            "tokens_per_second": self.generated_tokens / max(elapsed, 1e-9),
        }
        # Where the time went since the start (seconds of calls, summed over those in
        # flight together) and the CPU this process used: `rollwire train` prints it.
        entry.update(self.sampler.servers.clock.snapshot())
        servers = self.sampler.servers
        entry["rollout_servers"] = len(servers.rollout_stubs())  # those taking work now
        entry["reward_servers"] = len(servers.reward)
        if self.sampler.episodes is not None:
            entry["env_servers"] = len(self.sampler.pool.backends)
            entry["episode_restarts"] = self.sampler.episodes.restarts
            entry["env_servers_lost"] = self.sampler.pool.lost_count
        self.progress_log.write(json.dumps(entry) + "\n")
        self.progress_log.flush()

    async def close(self) -> None:
        """Stops the watchdog and closes the logs and every connection."""
        self.watchdog.stop()
        self.producer.close()
        self.eval_log.close()
        self.progress_log.close()
        await self.sampler.close()
        if self.teacher is not None:
            await self.teacher.close()


def run_orchestrator(config: RunConfig) -> int:
    """`rollwire orchestrator`: feed the buffer until the trainer reaches rl.max_steps."""
    import signal

    from transformers import AutoTokenizer

    from rollwire.services.core.tiny import quiet_transformers

    quiet_transformers()

    from rollwire.services.core.telemetry import (
        configure_logging,
        configure_tracing,
        dump_tasks_on_signal,
    )
    from rollwire.services.core.tiny import default_model_path

    configure_logging("orchestrator", config.telemetry.log_level, config.telemetry.log_format)
    provider = configure_tracing("orchestrator", config.telemetry.trace_exporter)
    endpoints = config.endpoints
    agentic = isinstance(config.orchestrator.dataset, EnvDataset)
    if (
        not endpoints.rollout_servers
        or not (endpoints.reward_servers or agentic)
        or not endpoints.buffer_producer
    ):
        log.error(
            "the orchestrator needs endpoints.rollout_servers, endpoints.reward_servers "
            "(unless an env gives the rewards) and endpoints.buffer_producer"
        )
        return 1
    # An image run has no tokens: its prompts go to the diffusion engine as they are.
    tokenizer = (
        None
        if isinstance(config.orchestrator.dataset, ImageDataset)
        else AutoTokenizer.from_pretrained(config.rollout_server.model_path or default_model_path())
    )

    async def main() -> int:
        orchestrator = Orchestrator(config, tokenizer)
        work = asyncio.ensure_future(orchestrator.run())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, work.cancel)
        dump_tasks_on_signal(loop, "orchestrator")
        try:
            await work
        except asyncio.CancelledError:
            log.info("stopped by signal")
        finally:
            await orchestrator.close()
        return 0

    try:
        return asyncio.run(main())
    except (ValueError, GroupsKeepFailing) as error:  # settings or data: the same next time
        log.error("orchestrator stopped: %s", describe_error(error))
        return EXIT_NO_RESTART
    except (OSError, TimeoutError, grpc.aio.AioRpcError) as error:
        log.error("orchestrator stopped: %s", describe_error(error))
        return 1
    finally:
        if provider is not None:
            provider.shutdown()  # sends the spans still batched
