"""The reward-server: batched scoring by domain behind `rollwire.v1.RewardService`.

Items are scored in worker processes (`rollwire.reward.pool`), each under its
own time limit; the `judge` and `reward_model` domains, when configured, score their
items of a call together (`rollwire.reward.judge`, `rollwire.reward.reward_model`).
A scorer that raises or runs out of time gives its item reward 0 with `error` set
and a counter; the call still succeeds. A malformed request
(no items, duplicate ids, unknown domain, too many items) is refused as a
whole with a status that says what to fix.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import Any

import grpc
import grpc.aio

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc
from rollwire.reward.pool import MAX_ERROR_CHARS, ScorerFailed, ScoringPool
from rollwire.reward.scorers import Score, ScoreInput
from rollwire.reward.table import scorer_table
from rollwire.services.core.config import ClientConfig, RewardServerConfig, SandboxConfig
from rollwire.services.core.metrics import COUNTERS, GAUGES
from rollwire.services.core.sandbox import SandboxUnavailable
from rollwire.services.core.server import Registration, reject
from rollwire.services.core.structs import from_struct

log = logging.getLogger(__name__)
SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Routes each item to the scorer of its domain."""

    def __init__(self, config: RewardServerConfig, client: ClientConfig | None = None) -> None:
        """`client`: how this server calls others (a judge on a rollout-server: its token,
        TLS)."""
        self.config = config
        sandbox: SandboxConfig | None = config.sandbox
        self._no_sandbox: str | None = None
        try:  # fails fast on a bad custom scorer
            self._scorers = scorer_table(config.custom_scorers, sandbox)
        except SandboxUnavailable as error:
            self._no_sandbox = f"the code domain cannot run here: {error}"
            log.warning(self._no_sandbox)
            sandbox = None
            self._scorers = scorer_table(config.custom_scorers)
        self.workers = config.workers or min(8, os.cpu_count() or 1)
        self._pool = ScoringPool(
            self.workers, custom_scorers=config.custom_scorers, sandbox=sandbox
        )
        # Domains whose items of a call are scored together, in this process.
        self._batched: dict[str, Any] = {}
        if config.judge is not None:
            from rollwire.reward.judge import Judge

            self._batched["judge"] = Judge(config.judge, client)
        if config.reward_model is not None:
            from rollwire.reward.reward_model import RewardModel

            self._batched["reward_model"] = RewardModel(config.reward_model)
        GAUGES.register(
            "reward_idle_workers", self._pool.idle_workers, "scorer workers free to take an item"
        )
        GAUGES.register(
            "reward_waiting_items",
            lambda: self._pool.waiting,
            "items waiting for a scorer worker (deploy/k8s scales reward-servers on it)",
        )
        log.info(
            "scorers: %s",
            ", ".join(f"{domain} -> {name}" for domain, name, _ in self.domains()),
        )

    def domains(self) -> list[tuple[str, str, str]]:
        """(domain, scorer, description) of every domain served, by domain."""
        rows = {
            domain: (name, _first_line(fn.__doc__)) for domain, (name, fn) in self._scorers.items()
        }
        rows |= {domain: (s.name, s.description) for domain, s in self._batched.items()}
        return [(domain, *rows[domain]) for domain in sorted(rows)]

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str
    ) -> None:
        await reject(context, "reward", code, reason, message)

    async def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListScorersResponse:
        return reward_pb2.ListScorersResponse(
            scorers=[
                reward_pb2.ScorerInfo(domain=domain, scorer=name, description=description)
                for domain, name, description in self.domains()
            ],
            parallel_items=self.workers,
            item_timeout_seconds=self.config.item_timeout_seconds,
        )

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        items = request.items
        if not items:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "empty", "the request has no items"
            )
        if len(items) > self.config.max_batch_items:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_items",
                f"{len(items)} items exceed the limit of {self.config.max_batch_items}; split the batch",
            )
        ids = [item.item_id for item in items]
        if len(set(ids)) != len(ids):
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "duplicate_ids",
                "item_id values must be unique within a request",
            )
        unknown = sorted(
            {item.domain for item in items} - self._scorers.keys() - self._batched.keys()
        )
        if "code" in unknown and self._no_sandbox:
            await self._reject(
                context, grpc.StatusCode.FAILED_PRECONDITION, "no_sandbox", self._no_sandbox
            )
        if unknown:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown_domain",
                f"no scorer for domain(s) {unknown}; this server scores: "
                f"{[domain for domain, _, _ in self.domains()]}",
            )
        asked = request.item_timeout_seconds
        if not math.isfinite(asked) or asked < 0:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_timeout",
                f"item_timeout_seconds must be a finite number >= 0, not {asked}",
            )
        timeout = asked or self.config.item_timeout_seconds
        if timeout > self.config.max_item_timeout_seconds:
            COUNTERS.inc("reward_timeouts_capped")
            timeout = self.config.max_item_timeout_seconds
        # Every item ends before the caller's deadline (a late one with its error flag), so
        # slow items cost themselves, not the whole call.
        remaining = context.time_remaining()
        deadline = (
            None
            if remaining is None
            else asyncio.get_running_loop().time() + remaining - min(1.0, 0.1 * remaining)
        )
        pooled = [item for item in items if item.domain not in self._batched]
        batches = {
            domain: [item for item in items if item.domain == domain]
            for domain in self._batched.keys() & {item.domain for item in items}
        }
        scored = await asyncio.gather(
            *(self._score_one(item, timeout, deadline) for item in pooled),
            *(
                self._score_batch(domain, group, timeout, deadline)
                for domain, group in batches.items()
            ),
        )
        by_id: dict[str, reward_pb2.ScoreResult] = {}
        for entry in scored:
            for result in entry if isinstance(entry, list) else [entry]:
                by_id[result.item_id] = result
        return reward_pb2.ScoreResponse(results=[by_id[item_id] for item_id in ids])

    async def _score_batch(
        self,
        domain: str,
        items: list[reward_pb2.ScoreItem],
        timeout: float,
        deadline: float | None,
    ) -> list[reward_pb2.ScoreResult]:
        verdicts = await self._batched[domain].score(
            [self._input(item) for item in items], timeout, deadline
        )
        return [self._result(item, verdict) for item, verdict in zip(items, verdicts, strict=True)]

    @staticmethod
    def _input(item: reward_pb2.ScoreItem) -> ScoreInput:
        return ScoreInput(
            response=item.response,
            reference=item.reference,
            prompt=item.prompt,
            metadata=from_struct(item.metadata) if item.HasField("metadata") else {},
            image=item.image,
        )

    def _result(
        self, item: reward_pb2.ScoreItem, verdict: Score | BaseException
    ) -> reward_pb2.ScoreResult:
        """The result of a batched domain's verdict on `item`, counted as the pool's are."""
        if isinstance(verdict, Score):
            COUNTERS.inc("reward_items_scored", domain=item.domain)
            return reward_pb2.ScoreResult(
                item_id=item.item_id, reward=verdict.reward, components=verdict.components
            )
        kind = "timeout" if isinstance(verdict, TimeoutError) else "exception"
        COUNTERS.inc("reward_item_errors", domain=item.domain, kind=kind)
        message = str(verdict)[:MAX_ERROR_CHARS] or type(verdict).__name__
        if kind == "exception":
            log.warning(
                "scorer failed",
                extra={"domain": item.domain, "item_id": item.item_id, "error": message},
            )
        return reward_pb2.ScoreResult(
            item_id=item.item_id, reward=0.0, error=True, error_message=message
        )

    async def _score_one(
        self, item: reward_pb2.ScoreItem, timeout: float, deadline: float | None = None
    ) -> reward_pb2.ScoreResult:
        try:
            score = await self._pool.score(
                item.domain, self._input(item), timeout, deadline=deadline
            )
        except TimeoutError as error:
            COUNTERS.inc("reward_item_errors", domain=item.domain, kind="timeout")
            return reward_pb2.ScoreResult(
                item_id=item.item_id,
                reward=0.0,
                error=True,
                error_message=str(error) or f"scorer timed out after {timeout:g}s",
            )
        except ScorerFailed as error:
            COUNTERS.inc("reward_item_errors", domain=item.domain, kind="exception")
            log.warning(
                "scorer failed",
                extra={"domain": item.domain, "item_id": item.item_id, "error": str(error)},
            )
            return reward_pb2.ScoreResult(
                item_id=item.item_id, reward=0.0, error=True, error_message=str(error)
            )
        COUNTERS.inc("reward_items_scored", domain=item.domain)
        return reward_pb2.ScoreResult(
            item_id=item.item_id, reward=score.reward, components=score.components
        )

    async def close(self) -> None:
        self._pool.close()
        for scorer in self._batched.values():
            await scorer.close()


def registrations(
    config: RewardServerConfig, client: ClientConfig | None = None
) -> list[Registration]:
    """What `rollwire reward-server` hosts; `client`: the run's client settings."""
    return [
        Registration(
            reward_pb2_grpc.add_RewardServiceServicer_to_server,
            RewardServicer(config, client),
            SERVICE_NAME,
        )
    ]
