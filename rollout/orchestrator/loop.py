"""The orchestrator: prompts in, scored trajectories out to the buffer.

For each task it samples `rl.group_size` responses from the rollout-servers,
scores them on a reward-server and sends each as a trajectory to the buffer.
It launches a group only while

    groups launched < (trainer version + staleness bound + 1) * groups per step

so it never produces what the buffer would have to throw away; with a bound
of 0 generation waits for each step (the synchronous mode). It evaluates the
policy on held-out prompts every `eval_every` versions, greedily.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc.aio
import numpy as np

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rollwire.services.buffer.client import BufferError, BufferProducer
from rollwire.services.core.client import describe_error, open_channel, wait_for_serving
from rollwire.services.core.config import EnvDataset, RunConfig
from rollwire.services.core.datasets import Task, cycle, load_tasks, task_at
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.structs import to_struct
from rollwire.services.core.watchdog import Watchdog
from rollwire.services.core.wire import Trajectory

log = logging.getLogger(__name__)


def sample_seed(base: int, ordinal: int) -> int:
    """The seed of sample 0 of prompt `ordinal` (sample i uses this + i), the same in every
    run with the same base: what lets a resumed run draw the samples it would have."""
    digest = hashlib.blake2b(f"{base}/{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # leaves room to add sample indices


def launch_capacity(
    trainer_version: int, staleness: int, per_step: int, total_steps: int, dropped_groups: int
) -> int:
    """Groups that may have been launched by now.

    Enough for the steps up to `staleness` versions ahead of the trainer, never
    more than the run needs; groups the buffer dropped as too stale (a slow
    episode can outlive the bound) are made up for, or the trainer would wait
    for groups that never come.
    """
    ahead = (trainer_version + staleness + 1) * per_step
    return min(ahead, (total_steps + 1) * per_step) + dropped_groups


class DynamicSampling:
    """Drops groups whose rewards are all equal, which give group-relative advantages
    nothing to learn from; the orchestrator samples another prompt in each one's place.

    At most `per_step` groups are dropped per policy version, so a run where every
    group is uniform (all solved, all failed) still moves.
    """

    def __init__(self, enabled: bool, per_step: int) -> None:
        self.enabled, self.per_step = enabled, per_step
        self._dropped: dict[int, int] = {}

    def drops(self, rewards: Sequence[float], version: int) -> bool:
        if not self.enabled or len(set(rewards)) > 1:
            return False
        dropped = self._dropped.get(version, 0)
        if dropped >= self.per_step:
            COUNTERS.inc("orchestrator_uniform_groups_kept")
            return False
        self._dropped[version] = dropped + 1
        COUNTERS.inc("orchestrator_groups_filtered", reward=str(rewards[0]))
        return True


def _waits(reason: str) -> bool:
    return reason == "full" or reason.startswith("storage:")


async def put_group_with_backpressure(
    producer: Any, trajectories: list[Trajectory], timeout: float
) -> list[Any]:
    """Puts a group in one message, waiting while the buffer is full rather than dropping
    anything.

    A full buffer means the trainer is behind; the producer slows down to its
    pace. A buffer that cannot write its log (reason "storage: ...") is waited
    for the same way. The trajectories refused for either reason are sent
    again (the others are not); past `timeout` a TimeoutError (the group is
    then counted as failed) instead of hanging."""
    deadline = time.monotonic() + timeout
    pause = 0.05
    results: list[Any] = [None] * len(trajectories)
    pending = list(range(len(trajectories)))
    while True:
        acks = await producer.put_group([trajectories[i] for i in pending])
        for index, ack in zip(pending, acks, strict=True):
            results[index] = ack
        pending = [i for i in pending if not results[i].accepted and _waits(results[i].reason)]
        if not pending:
            return results
        reason = results[pending[0]].reason
        COUNTERS.inc("orchestrator_backpressure_waits", reason=reason.split(":")[0])
        if time.monotonic() + pause > deadline:
            raise TimeoutError(f"the buffer did not take a group for {timeout:g}s: {reason}")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)


class Orchestrator:
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
        self.filtered = 0
        self.dynamic_sampling = DynamicSampling(
            self.settings.filter_uniform_groups, self.settings.max_replacements_per_step
        )
        self.generated_tokens = 0
        self.dropped_groups = 0
        self.watchdog = Watchdog("orchestrator")
        self.watch_seconds = config.telemetry.watchdog_seconds
        endpoints = config.endpoints
        self.rollout_channels = [open_channel(a, config.client) for a in endpoints.rollout_servers]
        self.reward_channels = [open_channel(a, config.client) for a in endpoints.reward_servers]
        self.rollout = [rollout_pb2_grpc.RolloutServiceStub(c) for c in self.rollout_channels]
        self.reward = [reward_pb2_grpc.RewardServiceStub(c) for c in self.reward_channels]
        self._next_rollout = itertools.cycle(range(len(self.rollout)))
        self._next_reward = itertools.cycle(range(len(self.reward)))
        self.producer = BufferProducer(endpoints.buffer_producer, curve=config.client.curve)
        self.run_dir = Path(config.run.output_dir)
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.eval_log = (self.run_dir / "metrics" / "eval.jsonl").open("a")
        self.progress_log = (self.run_dir / "metrics" / "orchestrator.jsonl").open("a")
        self.eos = int(tokenizer.eos_token_id)
        self.agentic = isinstance(self.settings.dataset, EnvDataset)
        self.pool = None
        self.episodes = None  # the EpisodeRunner, once the env-servers have answered
        if self.agentic:
            from rollwire.envs.pool import EnvPool

            # Env calls get the agent's own deadline: a long tool call is not a hung server.
            env_client = config.client.model_copy(
                update={"default_timeout_seconds": self.settings.agent.env_call_timeout_seconds}
            )
            self.pool = EnvPool.from_config(endpoints.env_servers, env_client, config.env_server)

    async def start_episodes(self) -> None:
        """Asks the env-servers what they offer (waiting for them to come up) and sets up
        the episode runner."""
        from rollwire.envs.client import EnvServerLost
        from rollwire.rollout.orchestrator.agent import EpisodeRunner

        deadline = time.monotonic() + self.config.client.connect_timeout_seconds
        while True:
            try:
                specs = await self.pool.specs()
                break
            except EnvServerLost as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no env-server of {self.config.endpoints.env_servers} answered within "
                        f"{self.config.client.connect_timeout_seconds:g}s: {error}"
                    ) from None
                await asyncio.sleep(0.2)
        self.episodes = EpisodeRunner(
            self.pool,
            specs,
            self.tokenizer,
            self.settings.agent,
            self.settings.max_new_tokens,
            self.settings.use_chat_template,
            self._generate_turn,
            self._score_episode,
        )
        env_id = self.settings.dataset.env_id
        spec = self.episodes.spec(env_id)
        if not spec.gives_reward and not self.reward:
            raise ValueError(
                f"env {env_id!r} does not give rewards itself; set endpoints.reward_servers"
            )

    async def _generate_turn(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float
    ) -> rollout_pb2.GenerateResponse:
        request = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=rollout_pb2.SamplingParams(
                temperature=temperature,
                top_p=self.settings.top_p,
                max_new_tokens=max_new_tokens,
                stop_token_ids=[self.eos],
            ),
        )
        stub = self.rollout[next(self._next_rollout)]
        return await self._with_retries(
            lambda: stub.Generate(request, timeout=self.settings.generate_timeout_seconds),
            "generate",
        )

    async def _score_episode(
        self, spec: Any, prompt: str, response: str, info: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """Reward-server score of an episode whose env gives no reward of its own."""
        reference = str(info.get("reference", ""))
        metadata = info.get("metadata") if isinstance(info.get("metadata"), dict) else {}
        task = Task(0, "", prompt, reference, spec.domain, spec.env_id, metadata)
        (result,) = await self.score(task, [response])
        return result.reward, dict(result.components)

    async def play_env_group(self, task: Task) -> list[Trajectory]:
        """`rl.group_size` episodes from one seed, each on its own."""
        episodes = await asyncio.gather(
            *(
                self.episodes.run(task, index, self.rl.temperature)
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
        results = await put_group_with_backpressure(
            self.producer, trajectories, self.config.trainer.batch_timeout_seconds
        )
        for trajectory, ack in zip(trajectories, results, strict=True):
            self._note_ack(trajectory, ack)
        return True

    def _note_ack(self, trajectory: Trajectory, ack: Any) -> None:
        self.trainer_version = max(self.trainer_version, ack.trainer_version)
        if not ack.accepted:
            COUNTERS.inc("orchestrator_refused", reason=ack.reason)
            log.warning(
                "buffer refused a trajectory",
                extra={"trajectory_id": trajectory.trajectory_id, "reason": ack.reason},
            )

    def encode_prompt(self, task: Task) -> list[int]:
        text = task.prompt(self.settings.prompt_template)
        if self.settings.use_chat_template:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] == self.eos else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def _with_retries(self, call, what: str):
        for attempt in range(1, self.settings.request_attempts + 1):
            try:
                return await call()
            except grpc.aio.AioRpcError as error:
                if attempt == self.settings.request_attempts or error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                COUNTERS.inc("orchestrator_retries", call=what)
                # Long enough in all for a restarted service to come back (a few seconds).
                await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))

    def _sampling(self, temperature: float) -> rollout_pb2.SamplingParams:
        return rollout_pb2.SamplingParams(
            temperature=temperature,
            top_p=self.settings.top_p,
            max_new_tokens=self.settings.max_new_tokens,
            stop_token_ids=[self.eos],
        )

    async def generate(
        self, prompt_ids: list[int], temperature: float
    ) -> rollout_pb2.GenerateResponse:
        request = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=self._sampling(temperature),
        )
        stub = self.rollout[next(self._next_rollout)]
        return await self._with_retries(
            lambda: stub.Generate(request, timeout=self.settings.generate_timeout_seconds),
            "generate",
        )

    async def generate_group(
        self, prompt_ids: list[int], ordinal: int | None = None
    ) -> list[rollout_pb2.GenerateResponse]:
        """`rl.group_size` samples of one prompt, in one call, batched on one rollout-server;
        seeded from the prompt's ordinal when `orchestrator.sampling_seed` is set."""
        sampling = self._sampling(self.rl.temperature)
        if self.settings.sampling_seed is not None and ordinal is not None:
            sampling.seed = sample_seed(self.settings.sampling_seed, ordinal)
        request = rollout_pb2.GenerateGroupRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            num_samples=self.rl.group_size,
        )
        stub = self.rollout[next(self._next_rollout)]
        reply = await self._with_retries(
            lambda: stub.GenerateGroup(request, timeout=self.settings.generate_timeout_seconds),
            "generate",
        )
        return list(reply.samples)

    async def score(self, task: Task, responses: list[str]) -> list[reward_pb2.ScoreResult]:
        metadata = to_struct(task.metadata)  # once per group, not once per response
        items = [
            reward_pb2.ScoreItem(
                item_id=str(i),
                domain=task.domain,
                prompt=task.question,
                response=text,
                reference=task.reference,
                metadata=metadata,
            )
            for i, text in enumerate(responses)
        ]
        stub = self.reward[next(self._next_reward)]
        reply = await self._with_retries(
            lambda: stub.Score(reward_pb2.ScoreRequest(items=items)), "score"
        )
        return sorted(reply.results, key=lambda r: int(r.item_id))

    async def run_group(self, task: Task) -> bool:
        """Samples, scores and sends one group; False when it was filtered out."""
        what = f"ordinal {task.ordinal} ({task.task_id})"
        with self.watchdog.watch("group", what, self.watch_seconds):
            if self.agentic:
                trajectories = await self.play_env_group(task)
            else:
                trajectories = await self.sample_group(task)
            return await self.send_group(trajectories)

    async def sample_group(self, task: Task) -> list[Trajectory]:
        """`rl.group_size` responses to one prompt, scored, as trajectories."""
        started = time.perf_counter()
        prompt_ids = self.encode_prompt(task)
        outputs = await self.generate_group(prompt_ids, task.ordinal)
        generated = time.perf_counter()
        texts = [self.decode(list(o.token_ids)) for o in outputs]
        scores = await self.score(task, texts)
        scored = time.perf_counter()
        trajectories = []
        for index, (output, result) in enumerate(zip(outputs, scores, strict=True)):
            response = np.asarray(output.token_ids, np.int32)
            prompt = np.asarray(prompt_ids, np.int32)
            trajectory = Trajectory(
                trajectory_id=f"{task.task_id}/{index}",
                group_id=task.task_id,
                task_id=task.task_id,
                sample_index=index,
                prompt_ordinal=task.ordinal,
                source=task.source,
                domain=task.domain,
                token_ids=np.concatenate([prompt, response]),
                loss_mask=np.concatenate(
                    [np.zeros(len(prompt), np.uint8), np.ones(len(response), np.uint8)]
                ),
                behaviour_logprobs=np.concatenate(
                    [np.zeros(len(prompt), np.float32), np.asarray(output.logprobs, np.float32)]
                ),
                policy_versions=np.concatenate(
                    [
                        np.full(len(prompt), -1, np.int64),
                        np.asarray(output.policy_versions, np.int64),
                    ]
                ),
                reward=result.reward,
                reward_components=dict(result.components),
                finish_reason=rollout_pb2.FinishReason.Name(output.finish_reason)
                .removeprefix("FINISH_REASON_")
                .lower(),
                timings={"generate": generated - started, "score": scored - generated},
            )
            trajectories.append(trajectory)
        self.generated_tokens += sum(len(o.token_ids) for o in outputs)
        return trajectories

    async def evaluate(self, tasks: Sequence[Task], version: int) -> float:
        """Greedy accuracy on held-out tasks; logged to metrics/eval.jsonl."""

        # As many requests in flight as training keeps, no more.
        limit = asyncio.Semaphore(self.settings.max_concurrent_groups * self.rl.group_size)

        async def one(task: Task) -> float:
            async with limit:
                if self.agentic:
                    return (await self.episodes.run(task, 0, temperature=0.0)).reward
                output = await self.generate(self.encode_prompt(task), temperature=0.0)
                (result,) = await self.score(task, [self.decode(list(output.token_ids))])
                return result.reward

        rewards = await asyncio.gather(*(one(t) for t in tasks))
        mean = float(np.mean(rewards))
        self.eval_log.write(
            json.dumps(
                {
                    "policy_version": version,
                    "eval_reward": mean,
                    "tasks": len(tasks),
                    "time": time.time(),
                }
            )
            + "\n"
        )
        self.eval_log.flush()
        log.info("evaluated", extra={"policy_version": version, "eval_reward": round(mean, 4)})
        return mean

    async def _evaluate_patiently(self, tasks: Sequence[Task], version: int) -> None:
        """An evaluation that meets a restarting service is tried again a few times, then
        skipped (counted): it must not end the run."""
        for attempt in range(1, 4):
            try:
                with self.watchdog.watch("evaluation", f"of version {version}", self.watch_seconds):
                    await self.evaluate(tasks, version)
                return
            except (grpc.aio.AioRpcError, OSError, RuntimeError) as error:
                COUNTERS.inc("orchestrator_eval_failures")
                log.warning(
                    "evaluation failed",
                    extra={"policy_version": version, "attempt": attempt, "error": str(error)},
                )
                await asyncio.sleep(2.0 * attempt)
        log.error("evaluation of version %d skipped after 3 failures", version)

    async def refresh_version(self) -> None:
        status = await self.producer.status()
        self.trainer_version = max(self.trainer_version, status["trainer_version"])
        # A trainer restarted from a checkpoint goes back to its step.
        self.trainer_step = status.get("trainer_step", status["trainer_version"])
        self.dropped_groups = status.get("outcomes", {}).get("stale", 0)

    async def resume_point(self, tasks: Sequence[Task]) -> tuple[list[Task], int]:
        """Where a (re)started orchestrator begins: the prompts the buffer's ledger shows
        unfinished and not held (a group lost with the previous orchestrator, or only
        part of it arrived), then the first ordinal never seen. Sets `launched` to the
        groups already in play, so the run does not produce more than it needs."""
        ledger = await self.producer.ledger()
        frontier, highest = int(ledger["frontier"]), int(ledger["highest"])
        finished = {int(o) for o in ledger["above"]}
        whole = {int(o) for o in ledger["whole"]}
        gaps = [o for o in range(frontier, highest + 1) if o not in finished and o not in whole]
        outcomes = ledger["outcomes"]
        given_up = outcomes.get("filtered", 0) + outcomes.get("failed", 0)
        self.launched = highest + 1 - given_up - len(gaps)
        self.resumed_gaps = len(gaps)
        if highest >= 0:
            log.info(
                "resuming from the buffer's ledger",
                extra={"frontier": frontier, "next": highest + 1, "gaps": len(gaps)},
            )
        return [task_at(tasks, o) for o in gaps], highest + 1

    async def run(self) -> None:
        for address, channel in zip(
            self.config.endpoints.rollout_servers + self.config.endpoints.reward_servers,
            self.rollout_channels + self.reward_channels,
            strict=True,
        ):
            await wait_for_serving(
                channel, timeout=self.config.client.connect_timeout_seconds, target=address
            )
        if self.agentic:
            await self.start_episodes()
        self.watchdog.start()
        dataset = load_tasks(self.settings.dataset)
        retry, start = await self.resume_point(dataset)
        retry_queue = deque(retry)
        fresh_tasks = cycle(dataset, start)
        eval_tasks = load_tasks(self.settings.eval_dataset) if self.settings.eval_dataset else []
        staleness, per_step, total_steps = (
            self.rl.staleness,
            self.rl.groups_per_step,
            self.rl.max_steps,
        )
        await self.refresh_version()
        running: dict[asyncio.Task[bool], Task] = {}
        failures: dict[int, int] = {}
        evaluated: set[int] = set()
        started = time.perf_counter()
        last_report = started
        try:
            while True:
                if (
                    eval_tasks
                    and self.trainer_version not in evaluated
                    and (
                        self.trainer_version % self.settings.eval_every == 0
                        or self.trainer_step >= total_steps
                    )
                ):
                    evaluated.add(self.trainer_version)
                    await self._evaluate_patiently(eval_tasks, self.trainer_version)
                if self.trainer_step >= total_steps:
                    break
                capacity = launch_capacity(
                    self.trainer_step, staleness, per_step, total_steps, self.dropped_groups
                )
                while (
                    self.launched < capacity and len(running) < self.settings.max_concurrent_groups
                ):
                    task = retry_queue.popleft() if retry_queue else next(fresh_tasks)
                    running[asyncio.ensure_future(self.run_group(task))] = task
                    self.launched += 1
                done = set()
                if running:
                    done, _ = await asyncio.wait(
                        running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
                    )
                else:
                    await asyncio.sleep(0.05)
                for finished in done:
                    task = running.pop(finished)
                    if finished.exception() is not None:
                        self.launched -= (
                            1  # the group never reached the buffer: make room for another
                        )
                        await self._group_failed(task, finished.exception(), failures, retry_queue)
                    elif finished.result() is False:
                        self.filtered += 1
                        self.launched -= (
                            1  # dropped by dynamic sampling: another prompt replaces it
                        )
                    else:
                        self.completed += 1
                # Acks carry the trainer version; ask the buffer only when that is all we wait for.
                if self.launched >= capacity or not running:
                    await self.refresh_version()
                if time.perf_counter() - last_report > 5:
                    last_report = time.perf_counter()
                    self._report(started)
        finally:
            for pending in running:
                pending.cancel()
            self._report(started)  # also when stopped by a signal

    async def _group_failed(
        self, task: Task, error: BaseException, failures: dict[int, int], retry_queue: deque
    ) -> None:
        """A group that failed is run again (first, before new prompts) up to
        `request_attempts` times; then its ordinal is given up, and the buffer told."""
        self.failed += 1
        COUNTERS.inc("orchestrator_failed_groups")
        failures[task.ordinal] = failures.get(task.ordinal, 0) + 1
        if failures[task.ordinal] < self.settings.request_attempts:
            log.warning("group failed; running it again: %s", error)
            retry_queue.append(task)
            return
        log.error("group failed %d times; giving it up: %s", failures[task.ordinal], error)
        try:
            await self.producer.drop(task.ordinal, task.task_id, "failed")
        except BufferError as lost:  # the ledger keeps it a gap: a restart runs it again
            log.error("could not tell the buffer: %s", lost)

    def _report(self, started: float) -> None:
        elapsed = time.perf_counter() - started
        entry = {
            "time": time.time(),
            "trainer_version": self.trainer_version,
            "groups_completed": self.completed,
            "groups_failed": self.failed,
            "groups_filtered": self.filtered,
            "groups_resumed": self.resumed_gaps,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": self.generated_tokens / max(elapsed, 1e-9),
        }
        if self.episodes is not None:
            entry["episode_restarts"] = self.episodes.restarts
            entry["env_servers_lost"] = self.pool.lost_count
        self.progress_log.write(json.dumps(entry) + "\n")
        self.progress_log.flush()

    async def close(self) -> None:
        self.watchdog.stop()
        self.producer.close()
        self.eval_log.close()
        self.progress_log.close()
        if self.pool is not None:
            await self.pool.aclose()
        for channel in self.rollout_channels + self.reward_channels:
            await channel.close()


def run_orchestrator(config: RunConfig) -> int:
    """`rollwire orchestrator`: feed the buffer until the trainer reaches rl.max_steps."""
    import signal

    from transformers import AutoTokenizer

    from rollwire.services.core.tiny import quiet_transformers

    quiet_transformers()

    from rollwire.services.core.telemetry import configure_logging, dump_tasks_on_signal
    from rollwire.services.core.tiny import default_model_path

    configure_logging("orchestrator", config.telemetry.log_level, config.telemetry.log_format)
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
    tokenizer = AutoTokenizer.from_pretrained(
        config.rollout_server.model_path or default_model_path()
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
    except (OSError, ValueError, TimeoutError, grpc.aio.AioRpcError) as error:
        log.error("orchestrator stopped: %s", describe_error(error))
        return 1
