"""The env-server: many environment sessions behind `rollwire.v1.EnvService`.

Sessions live in this process, keyed by a random id; a session with no call for
`session_idle_seconds` is closed. Every bad input becomes a gRPC status with a
message and a counter (`env_rejected{reason=...}`); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from rollwire.envs import registry
from rollwire.envs.base import Env, InvalidAction
from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.config import EnvServerConfig
from rollwire.services.metrics import COUNTERS
from rollwire.services.server import Registration, reject
from rollwire.services.structs import from_struct, to_struct

log = logging.getLogger(__name__)
SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name


@dataclass
class Session:
    env_id: str
    env: Env
    last_used: float
    done: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    """Hosts sessions of registered environments."""

    def __init__(self, config: EnvServerConfig, clock: Any = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._next_sweep = 0.0
        offered = config.envs
        known = {spec.env_id for spec in registry.list_specs()}
        if offered is not None and (missing := sorted(set(offered) - known)):
            raise ValueError(f"env_server.envs names unregistered env ids: {missing}")
        self._offered = set(known if offered is None else offered)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str
    ) -> None:
        await reject(context, "env", code, reason, message)

    def _sweep(self, force: bool = False) -> None:
        """Closes sessions idle past the limit; runs at most every few seconds unless forced."""
        now = self._clock()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + min(self.config.session_idle_seconds / 4, 5.0)
        cutoff = now - self.config.session_idle_seconds
        for session_id in [sid for sid, s in self._sessions.items() if s.last_used < cutoff]:
            self._drop(session_id, reason="expired")

    def _drop(self, session_id: str, reason: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        COUNTERS.inc("env_sessions_closed", reason=reason)
        try:
            session.env.close()
        except Exception:
            log.exception(
                "env close failed", extra={"env_id": session.env_id, "session_id": session_id}
            )
        return True

    async def ListEnvs(
        self, request: env_pb2.ListEnvsRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ListEnvsResponse:
        specs = [s for s in registry.list_specs() if s.env_id in self._offered]
        return env_pb2.ListEnvsResponse(
            envs=[
                env_pb2.EnvSpec(
                    env_id=s.env_id,
                    description=s.description,
                    domain=s.domain,
                    gives_reward=s.gives_reward,
                )
                for s in specs
            ]
        )

    async def Reset(
        self, request: env_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ResetResponse:
        if request.env_id not in self._offered:
            offered = ", ".join(sorted(self._offered)) or "none"
            await self._reject(
                context,
                grpc.StatusCode.NOT_FOUND,
                "unknown_env",
                f"unknown env id {request.env_id!r}; this server offers: {offered}",
            )
        self._sweep(force=len(self._sessions) >= self.config.max_sessions)
        if len(self._sessions) >= self.config.max_sessions:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "session_limit",
                f"this server holds its limit of {self.config.max_sessions} sessions; close finished ones or add servers",
            )
        kwargs = from_struct(request.env_kwargs) if request.HasField("env_kwargs") else {}
        try:
            env = registry.make(request.env_id, **kwargs)
        except (TypeError, ValueError) as error:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_env_kwargs",
                f"cannot create {request.env_id!r} with {kwargs}: {error}",
            )
        seed = request.seed if request.HasField("seed") else None
        try:
            observation, info = env.reset(seed)
        except Exception as error:
            COUNTERS.inc("env_errors", env_id=request.env_id, phase="reset")
            log.exception("env reset failed", extra={"env_id": request.env_id})
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"env {request.env_id!r} failed in reset: {type(error).__name__}: {error}",
            )
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = Session(request.env_id, env, self._clock())
        COUNTERS.inc("env_sessions_opened", env_id=request.env_id)
        return env_pb2.ResetResponse(
            session_id=session_id, observation=observation, info=to_struct(info)
        )

    async def Step(
        self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.StepResponse:
        self._sweep()
        session = self._sessions.get(request.session_id)
        if session is None:
            await self._reject(
                context,
                grpc.StatusCode.NOT_FOUND,
                "unknown_session",
                f"unknown or expired session {request.session_id!r}; call Reset to start one",
            )
        size = len(request.action.encode())
        if size > self.config.max_action_bytes:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "action_too_large",
                f"action of {size} bytes exceeds the limit of {self.config.max_action_bytes}",
            )
        async with session.lock:
            session.last_used = self._clock()
            if session.done:
                await self._reject(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "step_after_done",
                    "the episode has ended; call Reset for a new one or Close this session",
                )
            try:
                observation, reward, terminated, truncated, info = session.env.step(request.action)
            except InvalidAction as error:
                await self._reject(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "invalid_action",
                    f"env {session.env_id!r} rejected the action: {error}",
                )
            except Exception as error:
                COUNTERS.inc("env_errors", env_id=session.env_id, phase="step")
                log.exception(
                    "env step failed",
                    extra={"env_id": session.env_id, "session_id": request.session_id},
                )
                self._drop(request.session_id, reason="env_error")
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"env {session.env_id!r} failed in step: {type(error).__name__}: {error}; the session is closed",
                )
            session.done = bool(terminated or truncated)
        return env_pb2.StepResponse(
            observation=observation,
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=to_struct(info),
        )

    async def Close(
        self, request: env_pb2.CloseRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.CloseResponse:
        return env_pb2.CloseResponse(existed=self._drop(request.session_id, reason="closed"))


def registrations(config: EnvServerConfig) -> list[Registration]:
    """What `rollwire env-server` hosts."""
    return [
        Registration(
            env_pb2_grpc.add_EnvServiceServicer_to_server, EnvServicer(config), SERVICE_NAME
        )
    ]
