"""The rollout- and reward-servers, as the orchestrator calls them.

Generate calls go round-robin over the rollout-servers. A Score call goes to a
reward-server that serves the items' domain (each one's `ListScorers`, asked at
connect), the one with the fewest items in flight for its size. A call that finds
its server unavailable (restarting) or past its deadline is tried again,
`orchestrator.request_attempts` times in all, 0.25 s apart and doubling; each retry
is counted in `orchestrator_retries{call}`. A reward-server that failed so is passed
over for `REWARD_SERVER_PAUSE_SECONDS` while another serves the domain, so a lost
server's items are scored by the others.

The members can change during the run (`rollwire.services.core.members`: DNS names
re-resolved, the launcher's members file). A rollout-server that joins gets work once
it serves the policy version the others do (the trainer sends it the weights); one
that leaves gets no new calls and is closed when its calls in flight end. Every
attempt of a call picks its server anew, so a retry after a server was lost goes to
another one: a group's request is answered once, by one server, whoever serves it.

A Score call's deadline grows with its batch: the server scores `parallel_items` at
once, each within its item limit, so `ceil(items / parallel_items) x item limit`, plus
a margin, leaves every item its own limit (the server cuts late items at the
deadline with their error flag, never the whole call).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rollwire.services.core.client import describe_error, open_channel, wait_for_serving
from rollwire.services.core.config import RunConfig
from rollwire.services.core.datasets import Task
from rollwire.services.core.images import ImageRef, to_proto
from rollwire.services.core.members import Membership
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, call_with_retries, grpc_codes
from rollwire.services.core.seeds import stream_seed
from rollwire.services.core.structs import to_struct
from rollwire.services.core.timing import PhaseClock

T = TypeVar("T")
log = logging.getLogger(__name__)

# A server that is restarting (unavailable) or swamped (past the deadline) is tried again.
_SERVER_BUSY = grpc_codes("UNAVAILABLE", "DEADLINE_EXCEEDED")


REWARD_SERVER_PAUSE_SECONDS = 10.0
"""How long a reward-server that was unavailable or late is passed over, while another
serves the domain."""
SCORE_DEADLINE_MARGIN_SECONDS = 5.0
"""Added to a Score call's deadline beyond its items' limits: transport and queueing."""


ADMIT_POLL_SECONDS = 0.5
"""How often a joining rollout-server is asked whether it serves the current version."""


class NoScorer(ValueError):
    """No reward-server serves a domain the run scores."""


class NoRolloutServer(RuntimeError):
    """No rollout-server has been ready to take work for the connect timeout."""


@dataclass(eq=False)
class RolloutServer:
    """One rollout-server: its channel, and whether it takes work yet."""

    address: str
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    ready: bool = False
    """Takes work: a member of the start at once, one that joins once it serves the
    version the others serve."""
    joined_at: float = 0.0
    in_flight: int = 0
    leaving: bool = False


@dataclass(eq=False)
class RewardServer:
    """One reward-server: its stub and what its ListScorers said."""

    address: str
    stub: reward_pb2_grpc.RewardServiceStub
    channel: grpc.aio.Channel | None = None
    leaving: bool = False
    domains: frozenset[str] = frozenset()
    parallel_items: int = 1
    item_timeout_seconds: float = 10.0
    discovered: bool = False
    """Whether its ListScorers has answered."""
    in_flight: int = 0
    """Items sent and not yet answered."""
    passed_over_until: float = 0.0
    """Event-loop time until which it is not chosen while another serves the domain."""


def server_retries(config: RunConfig) -> RetryPolicy:
    """orchestrator.request_attempts tries, 0.25 s apart and doubling to 4 s: long enough
    in all for a restarted service to come back (a few seconds)."""
    return RetryPolicy(
        attempts=config.orchestrator.request_attempts, first_pause=0.25, max_pause=4.0
    )


async def call_server(call: Callable[[], Awaitable[T]], retries: RetryPolicy, what: str) -> T:
    """`call()`, tried again while its server is unavailable or past the deadline, each
    retry counted in `orchestrator_retries{call=what}`."""

    def retrying(error: BaseException, attempt: int) -> None:
        COUNTERS.inc("orchestrator_retries", call=what)
        log.warning(
            "%s call failed (%s); trying again (attempt %d of %s)",
            what,
            describe_error(error)[:300],
            attempt + 1,
            retries.attempts,
        )

    return await call_with_retries(
        call, retries, what=what, retryable=_SERVER_BUSY, on_retry=retrying
    )


def sample_seed(base: int, ordinal: int) -> int:
    """The seed of sample 0 of prompt `ordinal` (sample i uses this + i), the same in every
    run with the same base: what lets a resumed run draw the samples it would have."""
    digest = hashlib.blake2b(f"{base}/{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # leaves room to add sample indices


class Servers:
    """Generate calls to the rollout-servers and Score calls to the reward-servers;
    `eos` is the token every response stops at."""

    def __init__(self, config: RunConfig, eos: int) -> None:
        self.config = config
        self.rl = config.rl
        self.settings = config.orchestrator
        base = self.settings.sampling_seed
        # The samples' seeds come from this, the prompt's ordinal and the sample's index.
        self.sampling_base = (
            None if base is None else stream_seed(config.run.seed, "sampling", base)
        )
        self.eos = eos
        self.retries = server_retries(config)
        self.clock = PhaseClock()
        """Seconds in each kind of call (summed over calls in flight at once), and the
        rollout-servers' own account of generation: queueing and generating."""
        endpoints = config.endpoints
        self.rollout_members = Membership.of("rollout-server", endpoints)
        self.reward_members = Membership.of("reward-server", endpoints)
        self.rollout: dict[str, RolloutServer] = {}
        """The rollout-servers by address (those that left are not here)."""
        self.reward: list[RewardServer] = []
        for address in self.rollout_members.members:  # those of the start take work at once
            self._add_rollout(address).ready = True
        for address in self.reward_members.members:
            self._add_reward(address)
        self._turn = itertools.count()
        self._discovery = asyncio.Lock()
        self._admitting: dict[str, asyncio.Task[None]] = {}
        self._refreshing: asyncio.Task[None] | None = None

    def _add_rollout(self, address: str) -> RolloutServer:
        channel = open_channel(address, self.config.client)
        server = RolloutServer(
            address,
            channel,
            rollout_pb2_grpc.RolloutServiceStub(channel),
            joined_at=time.monotonic(),
        )
        self.rollout[address] = server
        return server

    def _add_reward(self, address: str) -> RewardServer:
        channel = open_channel(address, self.config.client)
        server = RewardServer(address, reward_pb2_grpc.RewardServiceStub(channel), channel)
        self.reward.append(server)
        return server

    def rollout_stubs(self) -> list[rollout_pb2_grpc.RolloutServiceStub]:
        """The stubs of the rollout-servers that take work now."""
        return [server.stub for server in self.rollout.values() if server.ready]

    async def wait_until_serving(self) -> None:
        """Returns once every server reports SERVING (or raises past the connect timeout)."""
        timeout = self.config.client.connect_timeout_seconds
        for server in self.rollout.values():
            await wait_for_serving(server.channel, timeout=timeout, target=server.address)
        for reward in self.reward:
            assert reward.channel is not None
            await wait_for_serving(reward.channel, timeout=timeout, target=reward.address)
        await self.discover_scorers()
        log.info(
            "servers serving",
            extra={"rollout_servers": sorted(self.rollout), "reward_servers": len(self.reward)},
        )

    # ------------------------------------------------------------ members joining and leaving

    def _refresh(self) -> None:
        """Looks at the members again when due (in a thread: a DNS lookup can block)."""
        due = self.rollout_members.due() or self.reward_members.due()
        if due and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._apply_changes(), name="members")

    async def _apply_changes(self) -> None:
        rollout = await asyncio.to_thread(self.rollout_members.refresh)
        reward = await asyncio.to_thread(self.reward_members.refresh)
        for address in rollout.joined:
            server = self._add_rollout(address)
            self._admitting[address] = asyncio.create_task(
                self._admit(server), name=f"admit {address}"
            )
        for address in rollout.left:
            server = self.rollout.pop(address)
            server.leaving = True
            if (task := self._admitting.pop(address, None)) is not None:
                task.cancel()
            log.info("rollout-server %s left: no new work goes to it", address)
            if server.in_flight == 0:
                await server.channel.close()
        for address in reward.joined:
            self._add_reward(address)
            log.info(
                "reward-server %s joined; it is asked what it scores at the next call", address
            )
        for address in reward.left:
            for server in [s for s in self.reward if s.address == address]:
                self.reward.remove(server)
                server.leaving = True
                if server.in_flight == 0 and server.channel is not None:
                    await server.channel.close()

    async def _admit(self, server: RolloutServer) -> None:
        """Sends work to a joining rollout-server once it serves the policy version the
        others serve (a new one starts from the initial weights until the trainer sends
        it the current ones). Polls while it stays a member; says so if that is long."""
        patience = self.config.client.connect_timeout_seconds
        warned = False
        request = rollout_pb2.RolloutStatusRequest()
        while not server.leaving:
            try:
                status = await server.stub.GetStatus(request, timeout=2.0)
                floor = await self._served_version()
                if status.policy_version >= floor:
                    server.ready = True
                    COUNTERS.inc("orchestrator_rollout_servers_admitted")
                    log.info(
                        "rollout-server %s serves version %d: it takes work now (%.1f s after it joined)",
                        server.address,
                        status.policy_version,
                        time.monotonic() - server.joined_at,
                    )
                    return
                why = f"it serves version {status.policy_version}, the others {floor}"
            except grpc.aio.AioRpcError as error:
                why = describe_error(error)[:200]
            if not warned and time.monotonic() - server.joined_at > patience:
                warned = True
                log.warning(
                    "rollout-server %s joined %.0f s ago and takes no work yet: %s",
                    server.address,
                    time.monotonic() - server.joined_at,
                    why,
                )
            await asyncio.sleep(ADMIT_POLL_SECONDS)

    async def _served_version(self) -> int:
        """The newest policy version a ready rollout-server reports (0 when none answers)."""
        request = rollout_pb2.RolloutStatusRequest()
        versions = [0]
        for server in [s for s in self.rollout.values() if s.ready]:
            try:
                status = await server.stub.GetStatus(request, timeout=2.0)
            except grpc.aio.AioRpcError:
                continue
            versions.append(status.policy_version)
        return max(versions)

    async def _rollout_server(self) -> RolloutServer:
        """The next ready rollout-server, round-robin; waits (up to the connect timeout)
        while none is ready: NoRolloutServer past it."""
        self._refresh()
        deadline = time.monotonic() + self.config.client.connect_timeout_seconds
        while True:
            ready = [server for server in self.rollout.values() if server.ready]
            if ready:
                return ready[next(self._turn) % len(ready)]
            if time.monotonic() > deadline:
                raise NoRolloutServer(
                    "no rollout-server has taken work for "
                    f"{self.config.client.connect_timeout_seconds:g}s; members: "
                    f"{sorted(self.rollout) or 'none'}"
                )
            await asyncio.sleep(0.2)
            self._refresh()

    async def _on_rollout(
        self, call: Callable[[rollout_pb2_grpc.RolloutServiceStub], Awaitable[T]], what: str
    ) -> T:
        """`call(stub)` on a rollout-server picked for each attempt, retried as `_call` does."""

        async def attempt() -> T:
            server = await self._rollout_server()
            server.in_flight += 1
            try:
                return await call(server.stub)
            finally:
                server.in_flight -= 1
                if server.leaving and server.in_flight == 0:
                    await server.channel.close()

        return await self._call(attempt, what)

    async def discover_scorers(self) -> None:
        """Asks each reward-server (until it answers) which domains it scores, how many
        items at once and under which item limit; one that does not answer is asked again
        at the next call."""
        async with self._discovery:
            for server in self.reward:
                if server.discovered:
                    continue
                try:
                    listed = await server.stub.ListScorers(
                        reward_pb2.ListScorersRequest(),
                        timeout=self.config.client.default_timeout_seconds,
                    )
                except grpc.aio.AioRpcError as error:
                    log.warning(
                        "reward-server %s did not say what it scores: %s",
                        server.address,
                        error.code().name,
                    )
                    continue
                server.domains = frozenset(scorer.domain for scorer in listed.scorers)
                server.parallel_items = max(1, listed.parallel_items)  # 0: an older server
                server.item_timeout_seconds = listed.item_timeout_seconds or 10.0
                server.discovered = True

    def check_domains(self, domains: Iterable[str]) -> None:
        """Raises NoScorer naming each domain no reward-server serves, and what they do."""
        served = set().union(*(server.domains for server in self.reward))
        missing = sorted(set(domains) - served)
        if missing:
            raise NoScorer(
                f"no reward-server scores domain(s) {missing}; "
                + "; ".join(
                    f"{s.address} scores {sorted(s.domains)}"
                    if s.discovered
                    else f"{s.address} has not answered ListScorers"
                    for s in self.reward
                )
            )

    def _reward_server_for(self, domain: str) -> RewardServer:
        """The least loaded reward-server of `domain`, passing over one that just failed
        while another serves it."""
        serving = [server for server in self.reward if domain in server.domains]
        if not serving:
            self.check_domains([domain])
        now = asyncio.get_running_loop().time()
        healthy = [server for server in serving if server.passed_over_until <= now] or serving
        return min(healthy, key=lambda server: server.in_flight / server.parallel_items)

    async def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        images: Sequence[ImageRef] = (),
    ) -> rollout_pb2.GenerateResponse:
        """One response to `prompt_ids` (showing `images`), of at most `max_new_tokens`:
        a single-turn evaluation's, or one turn of an episode."""
        request = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=self._sampling(temperature, max_new_tokens),
            images=[to_proto(image) for image in images],
        )
        return await self._on_rollout(
            lambda stub: stub.Generate(request, timeout=self.settings.generate_timeout_seconds),
            "generate",
        )

    async def generate_group(
        self,
        prompt_ids: list[int],
        ordinal: int | None = None,
        samples: int | None = None,
        images: Sequence[ImageRef] = (),
    ) -> list[rollout_pb2.GenerateResponse]:
        """`samples` (`rl.group_size` by default) samples of one prompt (showing
        `images`), in one call, batched on one rollout-server; seeded from the prompt's
        ordinal when `orchestrator.sampling_seed` is set."""
        sampling = self._sampling(self.rl.temperature, self.settings.max_new_tokens)
        if self.sampling_base is not None and ordinal is not None:
            sampling.seed = sample_seed(self.sampling_base, ordinal)
        request = rollout_pb2.GenerateGroupRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            num_samples=samples or self.rl.group_size,
            images=[to_proto(image) for image in images],
        )
        reply = await self._on_rollout(
            lambda stub: stub.GenerateGroup(
                request, timeout=self.settings.generate_timeout_seconds
            ),
            "generate",
        )
        if reply.samples:  # the server's side of the call: the slowest sample's
            self.clock.add("rollout_queue", max(s.queue_seconds for s in reply.samples))
            self.clock.add("rollout_generate", max(s.generate_seconds for s in reply.samples))
        return list(reply.samples)

    async def generate_images(
        self, prompts: list[str], seeds: list[int], sampling: rollout_pb2.ImageSampling
    ) -> list[rollout_pb2.ImageSample]:
        """One image per (prompt, seed) from a diffusion rollout-server, in one call
        (`GenerateImages`), with the recorded steps `sampling` asks for."""
        request = rollout_pb2.GenerateImagesRequest(
            request_id=uuid.uuid4().hex, prompts=prompts, seeds=seeds, sampling=sampling
        )
        reply = await self._on_rollout(
            lambda stub: stub.GenerateImages(
                request, timeout=self.settings.generate_timeout_seconds
            ),
            "generate",
        )
        if reply.samples:
            self.clock.add("rollout_queue", max(s.queue_seconds for s in reply.samples))
            self.clock.add("rollout_generate", max(s.generate_seconds for s in reply.samples))
        return list(reply.samples)

    async def denoise(
        self, latents: np.ndarray, times: Sequence[float], labels: Sequence[int], guidance: float
    ) -> np.ndarray:
        """A diffusion rollout-server's clean predictions (`Denoise`) of `latents` [B, C, H,
        W] at `times` for `labels`, with classifier-free `guidance`: [B, C, H, W]."""
        from rollwire.services.core.wire import array_bytes, array_from_bytes

        request = rollout_pb2.DenoiseRequest(
            request_id=uuid.uuid4().hex,
            latents=array_bytes(latents),
            times=list(times),
            labels=list(labels),
            guidance=guidance,
        )
        reply = await self._on_rollout(
            lambda stub: stub.Denoise(request, timeout=self.settings.generate_timeout_seconds),
            "denoise",
        )
        clean = array_from_bytes(reply.clean, "clean")
        if clean.shape != latents.shape:
            raise ValueError(f"Denoise answered {list(clean.shape)} for {list(latents.shape)}")
        return clean

    async def score_tokens(
        self, sequences: list[tuple[list[int], int, Sequence[ImageRef]]], top_k: int = 0
    ) -> list[rollout_pb2.SequenceScores]:
        """The served model's scores (`ScoreTokens`) of (token ids, start, the images they
        show) sequences: each token's logprob from start on, and the top_k most likely
        tokens there."""
        request = rollout_pb2.ScoreTokensRequest(
            request_id=uuid.uuid4().hex,
            sequences=[
                rollout_pb2.TokenSequence(
                    token_ids=ids, start=start, images=[to_proto(image) for image in images]
                )
                for ids, start, images in sequences
            ],
            top_k=top_k,
        )
        reply = await self._on_rollout(
            lambda stub: stub.ScoreTokens(request, timeout=self.settings.generate_timeout_seconds),
            "score tokens",
        )
        return list(reply.sequences)

    def _sampling(self, temperature: float, max_new_tokens: int) -> rollout_pb2.SamplingParams:
        return rollout_pb2.SamplingParams(
            temperature=temperature,
            top_p=self.settings.top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=[self.eos],
        )

    async def score(
        self, task: Task, responses: list[str], images: list[bytes] | None = None
    ) -> list[reward_pb2.ScoreResult]:
        """The reward-server's scores of `responses` to `task` (with `images`, one per
        response, for an image domain), in their order."""
        metadata = to_struct(task.metadata)  # once per group, not once per response
        images = images if images is not None else [b""] * len(responses)
        items = [
            reward_pb2.ScoreItem(
                item_id=str(i),
                domain=task.domain,
                prompt=task.question,
                response=text,
                reference=task.reference,
                metadata=metadata,
                image=image,
            )
            for i, (text, image) in enumerate(zip(responses, images, strict=True))
        ]
        request = reward_pb2.ScoreRequest(items=items)

        async def attempt() -> reward_pb2.ScoreResponse:
            self._refresh()
            await self.discover_scorers()
            server = self._reward_server_for(task.domain)
            rounds = math.ceil(len(items) / server.parallel_items)
            deadline = max(
                self.config.client.default_timeout_seconds,
                rounds * server.item_timeout_seconds + SCORE_DEADLINE_MARGIN_SECONDS,
            )
            server.in_flight += len(items)
            try:
                return await server.stub.Score(request, timeout=deadline)
            except grpc.aio.AioRpcError as error:
                if _SERVER_BUSY(error):
                    loop = asyncio.get_running_loop()
                    server.passed_over_until = loop.time() + REWARD_SERVER_PAUSE_SECONDS
                    COUNTERS.inc("orchestrator_reward_server_failures", server=server.address)
                raise
            finally:
                server.in_flight -= len(items)
                if server.leaving and server.in_flight == 0 and server.channel is not None:
                    await server.channel.close()

        reply = await self._call(attempt, "score")
        return sorted(reply.results, key=lambda r: int(r.item_id))

    async def score_episode(
        self, spec: Any, prompt: str, response: str, info: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """Reward-server score of an episode whose env gives no reward of its own."""
        reference = str(info.get("reference", ""))
        metadata = info.get("metadata") if isinstance(info.get("metadata"), dict) else {}
        domain = str(info.get("domain") or spec.domain)  # an env may say, task by task
        task = Task(0, "", prompt, reference, domain, spec.env_id, metadata)
        (result,) = await self.score(task, [response])
        return result.reward, dict(result.components)

    async def _call(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        with self.clock.phase(what.replace(" ", "_")):
            return await call_server(call, self.retries, what)

    async def close(self) -> None:
        """Closes the connection to every server."""
        for task in self._admitting.values():
            task.cancel()
        for server in self.rollout.values():
            await server.channel.close()
        for reward in self.reward:
            if reward.channel is not None:
                await reward.channel.close()
