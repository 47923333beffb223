"""Environment sessions in plain Python: what the env-server and `LocalEnvs` share.

`SessionHost` owns the sessions of one process: it creates them, steps them,
closes them and forgets idle ones. It knows nothing of gRPC, so the same rules
(limits, error codes and messages, counters) hold for an env on a server and
an env in the trainer's own process. A refused or failed call raises
`EnvCallError` whose `code` is the name of the gRPC status the server answers
with, so a caller can handle local and remote errors alike.

Blocking environments. An env whose `reset`/`step`/`close` may take long (a
tool env running a subprocess, a sandbox) sets the attribute `blocking = True`
(on the class, or on the instance in its constructor; it is read once, when
the session opens). The async methods (`reset_async`, `step_async`,
`close_async`) run such an env's calls in a thread pool, so one slow session
never stalls the event loop that serves every other session; envs without the
attribute run inline, which is the fast path (no thread hop). A blocking
session's calls are serialised by a per-session lock, and an idle sweep never
expires a session while one of its calls runs. Env constructors always run
inline and should stay cheap: slow set-up belongs in `reset`.

Thread safety: every public method may be called from any thread. The session
table is guarded by one lock held only for dictionary work, never while an
env runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollwire.envs import registry
from rollwire.envs.base import Env, EnvSpec, EpisodeAborted, InvalidAction, Observation, StepResult
from rollwire.envs.mcp_hub import McpUnavailable
from rollwire.services.core.config import EnvServerConfig
from rollwire.services.core.images import ImageRef
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.sandbox import SandboxUnavailable

log = logging.getLogger(__name__)

ResetResult = tuple[str, str | Observation, dict[str, Any]]
"""(session_id, observation, info)."""


class EnvCallError(Exception):
    """A refused or failed environment call.

    `code` names the gRPC status the env-server answers with ("NOT_FOUND",
    "INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
    "INTERNAL", ...); `message` says what to do about it.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Session:
    """One live environment and the bookkeeping around it."""

    env_id: str
    env: Env
    last_used: float
    blocking: bool
    done: bool = False
    # Serialises a blocking env's calls across pool threads; uncontended (and
    # cheap) for inline envs, whose calls all run on one thread.
    lock: threading.Lock = field(default_factory=threading.Lock)


def _check_types(observation: Any, info: Any) -> None:
    """Catches an env that breaks the API here, with its name, rather than in the wire encoder."""
    if isinstance(observation, Observation):
        if not isinstance(observation.text, str):
            raise TypeError(f"Observation.text must be str, got {type(observation.text).__name__}")
        for image in observation.images:
            if not isinstance(image, ImageRef) or not (image.data or image.uri):
                raise TypeError(
                    f"Observation.images must hold ImageRefs with data or a uri, got {image!r:.80}"
                )
    elif not isinstance(observation, str):
        raise TypeError(f"observation must be str or Observation, got {type(observation).__name__}")
    if type(info) is not dict and not isinstance(info, dict):
        raise TypeError(f"info must be a dict, got {type(info).__name__}")


def is_blocking(env: Env) -> bool:
    """Whether `env` asked for its calls to run off the event loop (`blocking = True`)."""
    return bool(getattr(env, "blocking", False))


class SessionHost:
    """Sessions of registered environments, with idle expiry and limits.

    Raises `EnvCallError` for every refused input (counted as
    `env_rejected{reason}`) and for env failures (`env_errors{env_id,phase}`,
    code INTERNAL); opened and closed sessions are counted as
    `env_sessions_opened{env_id}` and `env_sessions_closed{reason}`.
    """

    def __init__(
        self,
        config: EnvServerConfig,
        clock: Callable[[], float] = time.monotonic,
        blocking_workers: int | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._blocking_workers = blocking_workers or config.blocking_threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._hubs: list[Any] = []  # the MCP hubs its envs were given, closed at shutdown
        # Resets admitted but not yet registered count toward the session limit,
        # so slow blocking resets cannot overshoot it together.
        self._reserved = 0
        self._next_sweep = 0.0
        # UTF-8 spends at most 4 bytes a character, so shorter actions skip encoding.
        self._short_action_chars = config.max_action_bytes // 4
        registry.load_plugins(config.plugins)
        offered = config.envs
        known = {spec.env_id for spec in registry.list_specs()}
        if offered is not None and (missing := sorted(set(offered) - known)):
            raise ValueError(f"env_server.envs names unregistered env ids: {missing}")
        self._offered = frozenset(known if offered is None else offered)

    # ------------------------------------------------------------ queries

    @property
    def session_count(self) -> int:
        """Sessions open now."""
        return len(self._sessions)

    def specs(self) -> list[EnvSpec]:
        """The environments this host offers, sorted by id."""
        return [spec for spec in registry.list_specs() if spec.env_id in self._offered]

    def session_is_blocking(self, session_id: str) -> bool:
        """Whether this session's env runs off the event loop; False for unknown sessions."""
        session = self._sessions.get(session_id)
        return session is not None and session.blocking

    # ------------------------------------------------------------ sync calls

    def reset(
        self, env_id: str, seed: int | None = None, kwargs: dict[str, Any] | None = None
    ) -> ResetResult:
        """Creates a session and returns (session_id, observation, info), in this thread.

        Raises EnvCallError: NOT_FOUND (env id not offered), RESOURCE_EXHAUSTED
        (session limit), INVALID_ARGUMENT (bad kwargs), INTERNAL (env.reset failed).
        """
        return self._open_session(env_id, self._admit(env_id, kwargs or {}), seed)

    def step(self, session_id: str, action: str) -> StepResult:
        """Applies `action` to a session, in this thread.

        Raises EnvCallError: NOT_FOUND (unknown or expired session),
        RESOURCE_EXHAUSTED (action over the size limit), FAILED_PRECONDITION
        (the episode ended), INVALID_ARGUMENT (the env rejected the action),
        INTERNAL (the env failed; the session is then closed).
        """
        session = self._checked_session(session_id, action)
        with session.lock:
            return self._step_locked(session_id, session, action)

    def close(self, session_id: str) -> bool:
        """Ends a session; False when it was unknown or had already expired.

        A blocking env's own `close` runs in the pool after any call it has in
        progress, so this returns at once.
        """
        return self._drop(session_id, reason="closed")

    def close_all(self) -> None:
        """Closes every session and lets the pool's threads finish; for shutdown."""
        with self._lock:
            session_ids = list(self._sessions)
        for session_id in session_ids:
            self._drop(session_id, reason="shutdown")
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        hubs, self._hubs = self._hubs, []
        for hub in hubs:  # the MCP servers the sessions used, after their sessions
            hub.close()

    # ------------------------------------------------------------ async calls

    async def reset_async(
        self, env_id: str, seed: int | None = None, kwargs: dict[str, Any] | None = None
    ) -> ResetResult:
        """`reset`, with a blocking env's `reset` run in the pool."""
        env = self._admit(env_id, kwargs or {})
        if is_blocking(env):
            # Registration happens in the pool too: if this caller is cancelled
            # meanwhile, the session still lands in the table and expires when idle.
            return await self._in_pool(self._open_session, env_id, env, seed)
        return self._open_session(env_id, env, seed)

    async def step_async(self, session_id: str, action: str) -> StepResult:
        """`step`, with a blocking env's `step` run in the pool."""
        session = self._checked_session(session_id, action)
        if session.blocking:
            return await self._in_pool(self.step, session_id, action)
        with session.lock:
            return self._step_locked(session_id, session, action)

    async def close_async(self, session_id: str) -> bool:
        """`close`; never blocks (a blocking env is closed in the pool)."""
        return self.close(session_id)

    # ------------------------------------------------------------ internals

    async def _in_pool(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor(), function, *args)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self._blocking_workers, thread_name_prefix="env-blocking"
                    )
        return self._pool

    def _reject(self, code: str, reason: str, message: str) -> EnvCallError:
        COUNTERS.inc("env_rejected", reason=reason)
        return EnvCallError(code, message)

    def _admit(self, env_id: str, kwargs: dict[str, Any]) -> Env:
        """Checks a reset against the offer and the limit, reserves a slot, makes the env."""
        if env_id not in self._offered:
            offered = ", ".join(sorted(self._offered)) or "none"
            raise self._reject(
                "NOT_FOUND",
                "unknown_env",
                f"unknown env id {env_id!r}; this server offers: {offered}",
            )
        limit = self.config.max_sessions
        self._sweep(force=len(self._sessions) + self._reserved >= limit)
        with self._lock:
            if len(self._sessions) + self._reserved >= limit:
                full = True
            else:
                full = False
                self._reserved += 1
        if full:
            raise self._reject(
                "RESOURCE_EXHAUSTED",
                "session_limit",
                f"this server holds its limit of {limit} sessions; close finished ones or add servers",
            )
        try:
            kwargs = self._provided(env_id, self._sandboxed(env_id, kwargs))
        except EnvCallError:
            self._release_reservation()
            raise
        try:
            return registry.make(env_id, **kwargs)
        except (TypeError, ValueError) as error:
            self._release_reservation()
            raise self._reject(
                "INVALID_ARGUMENT",
                "bad_env_kwargs",
                f"cannot create {env_id!r} with {kwargs}: {error}",
            ) from None
        except (SandboxUnavailable, McpUnavailable) as error:
            self._release_reservation()
            reason = "no_sandbox" if isinstance(error, SandboxUnavailable) else "mcp_unavailable"
            raise self._reject("FAILED_PRECONDITION", reason, str(error)) from None
        except Exception as error:
            self._release_reservation()
            COUNTERS.inc("env_errors", env_id=env_id, phase="create")
            log.exception("env creation failed", extra={"env_id": env_id})
            raise EnvCallError(
                "INTERNAL", f"env {env_id!r} failed to start: {type(error).__name__}: {error}"
            ) from None

    def _sandboxed(self, env_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The env's kwargs under the operator's sandbox (`env_server.sandbox`): an env that
        runs code gets the server's kind; a Reset asking for less isolation (no sandbox,
        a longer run, more memory) is refused unless the server lets clients lower it."""
        taken = registry.parameters(env_id)
        if "sandbox" not in taken:
            return kwargs
        policy = self.config.sandbox
        asked = dict(kwargs)
        lower = []
        if asked.setdefault("sandbox", policy.kind) == "none" and policy.kind == "bwrap":
            lower.append("sandbox: none")
        for name, most in (
            ("python_timeout_s", policy.max_timeout_s),
            ("python_memory_mb", policy.max_memory_mb),
        ):
            value = asked.get(name)
            if name in taken and isinstance(value, int | float) and value > most:
                lower.append(f"{name}: {value} (the server allows {most:g})")
        if lower and not policy.clients_may_lower:
            raise self._reject(
                "PERMISSION_DENIED",
                "sandbox",
                f"this env-server runs code in its own sandbox (env_server.sandbox); a client "
                f"may not ask for {', '.join(lower)}",
            )
        return asked

    def _provided(self, env_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The env's kwargs with what only the operator provides: the MCP servers of
        `env_server.mcp` for an env that takes `mcp`. A Reset naming them is refused."""
        if not registry.takes_mcp(env_id):
            return kwargs
        if "mcp" in kwargs:
            raise self._reject(
                "PERMISSION_DENIED",
                "mcp",
                "the MCP servers are the env-server's (env_server.mcp); a Reset names the ones "
                "a task uses in `servers`, it cannot give its own",
            )
        given = registry.provided(env_id, self.config)
        if given["mcp"] not in self._hubs:
            self._hubs.append(given["mcp"])
        return {**kwargs, **given}

    def _release_reservation(self) -> None:
        with self._lock:
            self._reserved -= 1

    def _open_session(self, env_id: str, env: Env, seed: int | None) -> ResetResult:
        """Runs `env.reset` and registers the session; the slot was reserved by `_admit`."""
        try:
            observation, info = env.reset(seed)
            _check_types(observation, info)
        except (EpisodeAborted, McpUnavailable) as error:
            self._release_reservation()
            self._close_env(env_id, "-", env)
            aborted = isinstance(error, EpisodeAborted)
            raise self._reject(
                "ABORTED" if aborted else "FAILED_PRECONDITION",
                "aborted" if aborted else "mcp_unavailable",
                f"env {env_id!r}: {error}",
            ) from None
        except Exception as error:
            self._release_reservation()
            COUNTERS.inc("env_errors", env_id=env_id, phase="reset")
            log.exception("env reset failed", extra={"env_id": env_id})
            self._close_env(env_id, "-", env)
            raise EnvCallError(
                "INTERNAL", f"env {env_id!r} failed in reset: {type(error).__name__}: {error}"
            ) from None
        session_id = uuid.uuid4().hex
        session = Session(env_id, env, self._clock(), is_blocking(env))
        with self._lock:
            self._reserved -= 1
            self._sessions[session_id] = session
        COUNTERS.inc("env_sessions_opened", env_id=env_id)
        return session_id, observation, info

    def _checked_session(self, session_id: str, action: str) -> Session:
        """The session a step addresses, after the checks that need no env."""
        self._sweep()
        session = self._sessions.get(session_id)
        if session is None:
            raise self._reject(
                "NOT_FOUND",
                "unknown_session",
                f"unknown or expired session {session_id!r}; call Reset to start one",
            )
        if len(action) > self._short_action_chars:
            size = len(action.encode())
            if size > self.config.max_action_bytes:
                raise self._reject(
                    "RESOURCE_EXHAUSTED",
                    "action_too_large",
                    f"action of {size} bytes exceeds the limit of {self.config.max_action_bytes}",
                )
        return session

    def _step_locked(self, session_id: str, session: Session, action: str) -> StepResult:
        """Runs one step; the caller holds `session.lock`."""
        session.last_used = self._clock()
        if session.done:
            raise self._reject(
                "FAILED_PRECONDITION",
                "step_after_done",
                "the episode has ended; call Reset for a new one or Close this session",
            )
        if self._sessions.get(session_id) is not session:
            # Closed or expired while this call waited for the lock.
            raise self._reject(
                "NOT_FOUND",
                "unknown_session",
                f"unknown or expired session {session_id!r}; call Reset to start one",
            )
        try:
            observation, reward, terminated, truncated, info = session.env.step(action)
            _check_types(observation, info)
            reward = float(reward)
        except InvalidAction as error:
            raise self._reject(
                "INVALID_ARGUMENT",
                "invalid_action",
                f"env {session.env_id!r} rejected the action: {error}",
            ) from None
        except EpisodeAborted as error:
            self._drop(session_id, reason="aborted")
            raise self._reject(
                "ABORTED", "aborted", f"env {session.env_id!r}: {error}; start the episode again"
            ) from None
        except Exception as error:
            COUNTERS.inc("env_errors", env_id=session.env_id, phase="step")
            log.exception(
                "env step failed", extra={"env_id": session.env_id, "session_id": session_id}
            )
            self._drop(session_id, reason="env_error")
            raise EnvCallError(
                "INTERNAL",
                f"env {session.env_id!r} failed in step: {type(error).__name__}: {error}; the session is closed",
            ) from None
        session.done = bool(terminated or truncated)
        session.last_used = self._clock()  # a long step must not count as idle time
        return observation, reward, bool(terminated), bool(truncated), info

    def _sweep(self, force: bool = False) -> None:
        """Closes sessions idle past the limit; runs at most every few seconds unless forced."""
        now = self._clock()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + min(self.config.session_idle_seconds / 4, 5.0)
        cutoff = now - self.config.session_idle_seconds
        with self._lock:
            # A session whose call is running is in use however long the call takes.
            expired = [
                sid
                for sid, s in self._sessions.items()
                if s.last_used < cutoff and not s.lock.locked()
            ]
        for session_id in expired:
            self._drop(session_id, reason="expired")

    def _drop(self, session_id: str, reason: str) -> bool:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        COUNTERS.inc("env_sessions_closed", reason=reason)
        if session.blocking:
            # After any call still running on it, and off the caller's thread.
            self._executor().submit(self._close_blocking, session_id, session)
        else:
            self._close_env(session.env_id, session_id, session.env)
        return True

    def _close_blocking(self, session_id: str, session: Session) -> None:
        with session.lock:
            self._close_env(session.env_id, session_id, session.env)

    @staticmethod
    def _close_env(env_id: str, session_id: str, env: Env) -> None:
        try:
            env.close()
        except Exception:
            log.exception("env close failed", extra={"env_id": env_id, "session_id": session_id})
