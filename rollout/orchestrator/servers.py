"""The rollout- and reward-servers, as the orchestrator calls them.

Generate calls go round-robin over the rollout-servers. A Score call goes to a
reward-server that serves the items' domain (each one's `ListScorers`, asked at
connect), the one with the fewest items in flight for its size. A call that finds
its server unavailable (restarting) or past its deadline is tried again,
`orchestrator.request_attempts` times in all, 0.25 s apart and doubling; each retry
is counted in `orchestrator_retries{call}`. A reward-server that failed so is passed
over for `REWARD_SERVER_PAUSE_SECONDS` while another serves the domain, so a lost
server's items are scored by the others.

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


class NoScorer(ValueError):
    """No reward-server serves a domain the run scores."""


@dataclass(eq=False)
class RewardServer:
    """One reward-server: its stub and what its ListScorers said."""

    address: str
    stub: reward_pb2_grpc.RewardServiceStub
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
        self.addresses = endpoints.rollout_servers + endpoints.reward_servers
        self.rollout_channels = [open_channel(a, config.client) for a in endpoints.rollout_servers]
        self.reward_channels = [open_channel(a, config.client) for a in endpoints.reward_servers]
        self.rollout = [rollout_pb2_grpc.RolloutServiceStub(c) for c in self.rollout_channels]
        self.reward = [
            RewardServer(address, reward_pb2_grpc.RewardServiceStub(channel))
            for address, channel in zip(endpoints.reward_servers, self.reward_channels, strict=True)
        ]
        self._next_rollout = itertools.cycle(range(len(self.rollout)))
        self._discovery = asyncio.Lock()

    async def wait_until_serving(self) -> None:
        """Returns once every server reports SERVING (or raises past the connect timeout)."""
        for address, channel in zip(
            self.addresses, self.rollout_channels + self.reward_channels, strict=True
        ):
            await wait_for_serving(
                channel, timeout=self.config.client.connect_timeout_seconds, target=address
            )
        await self.discover_scorers()

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
        stub = self.rollout[next(self._next_rollout)]
        return await self._call(
            lambda: stub.Generate(request, timeout=self.settings.generate_timeout_seconds),
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
        stub = self.rollout[next(self._next_rollout)]
        reply = await self._call(
            lambda: stub.GenerateGroup(request, timeout=self.settings.generate_timeout_seconds),
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
        stub = self.rollout[next(self._next_rollout)]
        reply = await self._call(
            lambda: stub.GenerateImages(request, timeout=self.settings.generate_timeout_seconds),
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
        stub = self.rollout[next(self._next_rollout)]
        reply = await self._call(
            lambda: stub.Denoise(request, timeout=self.settings.generate_timeout_seconds),
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
        stub = self.rollout[next(self._next_rollout)]
        reply = await self._call(
            lambda: stub.ScoreTokens(request, timeout=self.settings.generate_timeout_seconds),
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
        for channel in self.rollout_channels + self.reward_channels:
            await channel.close()
