"""What every part of `rollwire env-check` shares (see `rollwire.envs.check`).

`CheckOptions` says what to check; the exceptions are how a check gives its
verdict; `Reply` is one Step answer as determinism is judged on it; `Probe`
makes the calls a check needs on the server under test, turning the replies
the contract allows into values and the rest into `CheckFailed`. The suite in
`check` and the Multiplex check in `check_multiplex` both build on it, so
neither needs the other's internals.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from google.protobuf import json_format

from rollwire.proto.v1 import env_pb2, env_pb2_grpc
from rollwire.services.core.client import describe_error
from rollwire.services.core.structs import to_struct

# Spread-out numbers first (a number game answers them differently for
# different seeds), then the words grid, text and choice envs commonly take.
DEFAULT_ACTIONS: tuple[str, ...] = (
    "50", "left", "25", "right", "75", "up", "down", "1", "0", "yes",
    "no", "a", "b", "10", "90", "2", "100", "pass", "3", "hello",
)  # fmt: skip
UNKNOWN_ENV_ID = "rollwire-env-check-no-such-env"
KEPT_IMAGES = 64


@dataclass(frozen=True)
class CheckOptions:
    """What to check and how hard."""

    env_id: str | None = None
    """Env to exercise; the first one ListEnvs names when unset."""
    env_kwargs: dict[str, Any] | None = None
    """Constructor arguments sent with every Reset of that env."""
    actions: tuple[str, ...] = DEFAULT_ACTIONS
    """Candidate actions, stepped in this order; rejected ones are fine."""
    timeout: float = 10.0
    """Deadline of every call, and of connecting, in seconds."""
    sessions: int = 32
    """Sessions played at once by the concurrency check."""
    oversized_action_bytes: int = 1024 * 1024
    """Size of the action that must be refused; far above any sensible action limit."""
    max_steps: int = 200
    """Steps the step-contract check takes while waiting for an episode to end."""


class CheckFailed(Exception):
    """The server broke the contract."""


class CheckWarning(Exception):
    """Allowed by the contract but probably unintended."""


class CheckSkipped(Exception):
    """The check could not be judged; the message says why."""


def image_keys(images: Sequence[env_pb2.Image]) -> tuple[str, ...]:
    """Each image as determinism compares it: a digest of its bytes, or its uri."""
    return tuple(
        hashlib.sha256(image.data).hexdigest()[:16] if image.data else image.uri for image in images
    )


def info_dict(struct: Any) -> dict[str, Any]:
    """An `info` Struct as the plain dict determinism is compared on."""
    return json_format.MessageToDict(struct)


def code_name(number: int) -> str:
    """The name of a status code number as CallError carries it ("5" -> "NOT_FOUND")."""
    return next((code.name for code in grpc.StatusCode if code.value[0] == number), str(number))


@dataclass
class Reply:
    """One Step answer, reduced to what determinism is judged on."""

    code: str  # "OK" or the status code's name
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    images: tuple[str, ...] = ()
    """Each image the observation shows, by its bytes' digest or its uri."""

    @property
    def done(self) -> bool:
        """True when the env accepted the action and the episode ended with it."""
        return self.code == "OK" and (self.terminated or self.truncated)

    @classmethod
    def from_step(cls, step: env_pb2.StepResponse) -> Reply:
        """The reply a successful Step answered."""
        return cls(
            "OK",
            step.observation,
            step.reward,
            step.terminated,
            step.truncated,
            info_dict(step.info),
            image_keys(step.images),
        )

    def brief(self) -> str:
        """The reply in a few words, for a failure message."""
        if self.code != "OK":
            return self.code
        text = self.observation if len(self.observation) <= 40 else self.observation[:37] + "..."
        shown = f" images={list(self.images)}" if self.images else ""
        return f"{text!r}{shown} r={self.reward:g} term={self.terminated} trunc={self.truncated}"


class Probe:
    """Calls on one server's EnvService, sharing one channel and what earlier checks learned."""

    def __init__(
        self, channel: grpc.aio.Channel, options: CheckOptions, token: str | None = None
    ) -> None:
        self.channel = channel
        # grpc.aio files a channel interceptor under the first call kind it
        # implements only, so streaming calls must carry the token themselves.
        self.stream_metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = env_pb2_grpc.EnvServiceStub(channel)
        self.options = options
        self.timeout = options.timeout
        self.env_id = options.env_id
        # Transcripts of one session played alone, by seed: the reference that
        # determinism and concurrency are judged against.
        self.transcripts: dict[int, list[Reply]] = {}
        self.images: dict[str, env_pb2.Image] = {}
        """Distinct images the observations showed, by key (`image_keys`)."""
        self.accepted_action: str | None = None
        self.reset_refused = False

    def need_env(self) -> str:
        """The env id to exercise; skips the check when there is none."""
        if self.env_id is None:
            raise CheckSkipped("no env id to exercise (ListEnvs named none); pass --env-id")
        return self.env_id

    def reset_request(self, seed: int) -> env_pb2.ResetRequest:
        """A Reset of the env under test with `seed` and the configured kwargs."""
        request = env_pb2.ResetRequest(env_id=self.need_env(), seed=seed)
        if self.options.env_kwargs:
            request.env_kwargs.CopyFrom(to_struct(self.options.env_kwargs))
        return request

    async def reset(self, seed: int) -> tuple[str, Reply]:
        """Opens a session with `seed`; its id and the first observation as a Reply."""
        try:
            reply = await self.stub.Reset(self.reset_request(seed), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.INVALID_ARGUMENT:
                # Most likely the env needs kwargs we were not given: say so once,
                # and let the checks after it skip rather than repeat the failure.
                if self.reset_refused:
                    raise CheckSkipped(
                        "Reset refuses these kwargs (see the first failure)"
                    ) from None
                self.reset_refused = True
                kwargs = self.options.env_kwargs or {}
                raise CheckFailed(
                    f"Reset of {self.env_id!r} with kwargs {kwargs} refused: "
                    f"{describe_error(error)}; pass --env-kwargs with what this env needs"
                ) from None
            raise CheckFailed(f"Reset of {self.env_id!r} failed: {describe_error(error)}") from None
        if not reply.session_id:
            raise CheckFailed("Reset answered an empty session_id")
        self.keep_images(reply.images)
        return reply.session_id, Reply(
            "OK", reply.observation, info=info_dict(reply.info), images=image_keys(reply.images)
        )

    def raw_step(self, session_id: str, action: str) -> Awaitable[env_pb2.StepResponse]:
        """A Step call as is, for checks that expect it to fail."""
        request = env_pb2.StepRequest(session_id=session_id, action=action)
        return self.stub.Step(request, timeout=self.timeout)

    async def step(self, session_id: str, action: str) -> Reply:
        """A Step reply; INVALID_ARGUMENT is a reply too, any other error fails the check."""
        try:
            reply = await self.raw_step(session_id, action)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.INVALID_ARGUMENT:
                return Reply("INVALID_ARGUMENT")
            raise CheckFailed(
                f"Step {action[:40]!r} on a live session failed: {describe_error(error)}"
            ) from None
        if not math.isfinite(reply.reward):
            raise CheckFailed(f"Step {action[:40]!r} answered a non-finite reward {reply.reward}")
        if self.accepted_action is None:
            self.accepted_action = action
        self.keep_images(reply.images)
        return Reply.from_step(reply)

    def keep_images(self, images: Sequence[env_pb2.Image]) -> None:
        """Keeps the first KEPT_IMAGES distinct images observations showed, for the check
        that they open."""
        for key, image in zip(image_keys(images), images, strict=True):
            if len(self.images) < KEPT_IMAGES:
                self.images.setdefault(key, image)

    async def close(self, session_id: str) -> bool:
        """Closes a session; whether the server knew it."""
        request = env_pb2.CloseRequest(session_id=session_id)
        try:
            return (await self.stub.Close(request, timeout=self.timeout)).existed
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(f"Close failed: {describe_error(error)}") from None

    async def expect_error(
        self, call: Awaitable[Any], allowed: Sequence[grpc.StatusCode], what: str
    ) -> grpc.StatusCode:
        """Awaits a call that must fail with one of `allowed`; returns the code it gave."""
        names = " or ".join(code.name for code in allowed)
        try:
            await call
        except grpc.aio.AioRpcError as error:
            if error.code() in allowed:
                return error.code()
            raise CheckFailed(f"{what}: expected {names}, got {describe_error(error)}") from None
        raise CheckFailed(f"{what}: expected {names}, got OK")

    async def play_alone(self, seed: int) -> list[Reply]:
        """Reset with `seed`, then every candidate action once, until the episode ends."""
        session_id, first = await self.reset(seed)
        transcript = [first]
        try:
            for action in self.options.actions:
                reply = await self.step(session_id, action)
                transcript.append(reply)
                if reply.done:
                    break
        finally:
            await self.close(session_id)
        return transcript
