"""Multi-turn episodes: the policy acts, the environment answers, until the episode ends.

One episode is one token sequence. It starts with the first observation
rendered as a prompt; each turn appends the tokens the policy generated (loss
mask 1, with the engine's logprobs and policy versions) and then the
environment's answer rendered as context (loss mask 0). Token ids are kept as
generated, never re-tokenised from text, so the trainer scores exactly what
the engine sampled.

Every episode runs as its own coroutine: a slow environment holds up only
its own episode. An episode lives on one env-server; if that server is lost
mid-episode the episode starts again on another, from the same seed, and the
restart is counted.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rollwire.envs.base import EnvSpec, Observation, offered_tools, parts
from rollwire.envs.client import EnvBackend, EnvServerLost
from rollwire.envs.host import EnvCallError
from rollwire.envs.pool import EnvPool
from rollwire.proto.v1 import rollout_pb2
from rollwire.rollout.orchestrator.episode import EpisodeTokens, trajectory_from_episode
from rollwire.services.core.config import AgentConfig
from rollwire.services.core.datasets import Task
from rollwire.services.core.images import ImageError, ImageRef
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.retry import RetryPolicy, call_with_retries
from rollwire.services.core.vision import VisionSide
from rollwire.services.core.wire import Trajectory

log = logging.getLogger(__name__)

# (prompt token ids, max new tokens, temperature, the images the prompt shows) -> the answer
Generate = Callable[
    [list[int], int, float, list[ImageRef]], Awaitable[rollout_pb2.GenerateResponse]
]
# (spec, first observation, last action, last info) -> (reward, components)
Score = Callable[[EnvSpec, str, str, dict[str, Any]], Awaitable[tuple[float, dict[str, float]]]]


class EpisodeFailed(RuntimeError):
    """An episode could not be completed (its env failed, or every start was lost)."""


class EpisodeAborted(EnvServerLost):
    """The env-server ended the episode through no fault of the policy (a tool server it
    used was lost): started again from its seed, with the env-server kept in the pool."""


# ---------------------------------------------------------------- turns as tokens


Shown = tuple[list[int], list[ImageRef]]
"""Tokens to append, and the images they show with their offsets among them."""


def tool_lines(tools: list[dict[str, Any]]) -> str:
    """Tools in function-calling form as plain text, one line each:
    `name(argument: type, ...): description`."""
    lines = []
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        arguments = ", ".join(
            f"{name}: {spec.get('type', 'any')}" if isinstance(spec, dict) else str(name)
            for name, spec in properties.items()
        )
        description = " ".join(str(function.get("description") or "").split())
        lines.append(
            f"{function['name']}({arguments})" + (f": {description}" if description else "")
        )
    return "\n".join(lines)


def takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools=` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


class _Turns:
    """What both renderings share: an observation's pictures go before its text, as the
    policy's own image placeholders (`VisionSide.marker`, then `expand`); the tools an
    env offers, where the chat template does not render them, as `tool_prompt` before
    the first observation."""

    def __init__(self, tokenizer: Any, vision: VisionSide | None, tool_prompt: str) -> None:
        self.tokenizer, self.vision, self.tool_prompt = tokenizer, vision, tool_prompt
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token else ""

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, observation: str | Observation, before: str = "") -> tuple[str, list[ImageRef]]:
        """The observation's text with one marker per picture before it, and its pictures."""
        text, images = parts(observation)
        if not images:
            return before + text, []
        if self.vision is None:
            raise ImageError(
                f"the observation shows {len(images)} image(s), but the policy is not a "
                "vision-language model"
            )
        return before + self.vision.marker(self.tokenizer, len(images)) + text, list(images)

    def _tools_text(self, tools: list[dict[str, Any]] | None) -> str:
        return self.tool_prompt.format(tools=tool_lines(tools)) if tools else ""

    def _shown(self, ids: list[int], images: list[ImageRef]) -> Shown:
        if not images:
            return ids, []
        expanded, _, placed = self.vision.expand(ids, images)
        return expanded, placed


class PlainTurns(_Turns):
    """Observations written with a format string; the policy's turns end with its stop token."""

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        vision: VisionSide | None = None,
        tool_prompt: str = AgentConfig().tool_prompt,
    ) -> None:
        super().__init__(tokenizer, vision, tool_prompt)
        self.template = template
        self.texts: list[str] = []

    def first(
        self, observation: str | Observation, tools: list[dict[str, Any]] | None = None
    ) -> Shown:
        text, images = self._text(observation, self._tools_text(tools))
        rendered = self.template.format(observation=text)
        self.texts.append(rendered)
        return self._shown(self._encode(rendered), images)

    def then(
        self,
        action_text: str,
        stopped: bool,
        observation: str | Observation,
        role: str = "user",
    ) -> Shown:
        self.texts.append(action_text + (self.eos_text if stopped else ""))
        return self.first(observation)

    def transcript(self, action_text: str, stopped: bool) -> str:
        """The whole episode as text, ending with its last action."""
        return "".join(self.texts) + action_text + (self.eos_text if stopped else "")


class ChatTurns(_Turns):
    """Observations as user turns (tool results as tool turns, where the template renders
    tools) and actions as assistant turns of the tokenizer's chat template.

    The tokens of a new observation are the text the template adds when the
    observation is appended (rendered both ways and subtracted), so whatever
    the template writes between turns is in the context exactly once.
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None,
        vision: VisionSide | None = None,
        tool_prompt: str = AgentConfig().tool_prompt,
    ) -> None:
        super().__init__(tokenizer, vision, tool_prompt)
        self.messages: list[dict[str, str]] = []
        self.tools: list[dict[str, Any]] | None = None
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})

    def _render(self, generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def first(
        self, observation: str | Observation, tools: list[dict[str, Any]] | None = None
    ) -> Shown:
        if tools and takes_tools(self.tokenizer):
            self.tools = list(tools)
            text, images = self._text(observation)
        else:
            text, images = self._text(observation, self._tools_text(tools))
        self.messages.append({"role": "user", "content": text})
        return self._shown(self._encode(self._render(True)), images)

    def then(
        self,
        action_text: str,
        stopped: bool,
        observation: str | Observation,
        role: str = "user",
    ) -> Shown:
        text, images = self._text(observation)
        self.messages.append({"role": "assistant", "content": action_text})
        closed = self._render(False)
        # A tool result is a tool turn only for a template that renders tools.
        self.messages.append({"role": role if self.tools else "user", "content": text})
        opened = self._render(True)
        if not opened.startswith(closed):
            raise ValueError("the chat template rewrites earlier turns; use the plain format")
        # What the template writes after the action's text; the stop token the
        # policy generated already stands for its first part.
        at = closed.rfind(action_text)
        if at < 0:
            raise ValueError("the chat template rewrites the policy's turns; use the plain format")
        closing = closed[at + len(action_text) :]
        if stopped and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return self._shown(self._encode(closing + opened[len(closed) :]), images)

    def transcript(self, action_text: str, stopped: bool) -> str:
        """The whole conversation rendered by the template, ending with its last action."""
        self.messages.append({"role": "assistant", "content": action_text})
        try:
            return self._render(False)
        finally:
            self.messages.pop()


def token_drift(tokenizer: Any, transcript: str, ids: list[int]) -> int | None:
    """Where the episode's tokens `ids` first differ from its `transcript` tokenised whole
    (None where they agree; the transcript may go on past them, with what a template
    writes after the last action)."""
    again = list(tokenizer(transcript, add_special_tokens=False)["input_ids"])
    for at, (mine, theirs) in enumerate(zip(ids, again, strict=False)):
        if mine != theirs:
            return at
    return None if len(again) >= len(ids) else len(again)


# ---------------------------------------------------------------- one episode


async def env_specs(pool: EnvPool, timeout: float, addresses: list[str]) -> dict[str, EnvSpec]:
    """What the env-servers offer, asked every 0.2 s until one answers; past `timeout`
    seconds a TimeoutError naming `addresses` (the configured env-servers)."""
    # A steady 0.2 s between asks: the env-servers are starting up, not overloaded.
    poll = RetryPolicy(
        attempts=None, first_pause=0.2, multiplier=1.0, max_pause=0.2, total_seconds=timeout
    )
    try:
        return await call_with_retries(
            pool.specs,
            poll,
            what="the env-servers' specs",
            retryable=lambda error: isinstance(error, EnvServerLost),
        )
    except EnvServerLost as error:
        raise TimeoutError(
            f"no env-server of {addresses} answered within {timeout:g}s: {error}"
        ) from None


class EpisodeRunner:
    """Runs episodes of env tasks against a pool of env backends and a policy."""

    def __init__(
        self,
        pool: EnvPool,
        specs: dict[str, EnvSpec],
        tokenizer: Any,
        settings: AgentConfig,
        max_new_tokens: int,
        use_chat_template: bool,
        generate: Generate,
        score: Score,
        vision: VisionSide | None = None,
    ) -> None:
        self.pool, self.specs, self.tokenizer = pool, specs, tokenizer
        self.vision = vision
        """The policy's image side, when it is a vision-language model (image observations)."""
        self.settings = settings
        self.max_new_tokens = max_new_tokens
        self.use_chat_template = use_chat_template
        self.generate, self.score = generate, score
        self.eos = int(tokenizer.eos_token_id)
        self.restarts = 0
        self.drifts = 0
        """Episodes whose tokens differed from their conversation tokenised again."""

    def spec(self, env_id: str) -> EnvSpec:
        try:
            return self.specs[env_id]
        except KeyError:
            offered = ", ".join(sorted(self.specs)) or "none"
            raise EpisodeFailed(
                f"env id {env_id!r} is not offered by the env-servers; they offer: {offered}"
            ) from None

    def _turns(self) -> PlainTurns | ChatTurns:
        settings = self.settings
        if self.use_chat_template:
            return ChatTurns(
                self.tokenizer, settings.system_prompt, self.vision, settings.tool_prompt
            )
        return PlainTurns(
            self.tokenizer, settings.observation_template, self.vision, settings.tool_prompt
        )

    def decode(self, ids: list[int]) -> str:
        if ids and ids[-1] == self.eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def run(self, task: Task, sample_index: int, temperature: float) -> Trajectory:
        """One episode of `task`; restarted from its seed on another backend if one is lost."""
        spec = self.spec(task.metadata["env_id"])
        attempts = self.settings.episode_attempts
        lost: list[tuple[str, EnvServerLost]] = []  # (address, error) of each backend lost

        async def on_some_backend() -> Trajectory:
            backend = self.pool.pick()
            try:
                with self.pool.lease(backend):
                    return await self._run_on(backend, spec, task, sample_index, temperature)
            except EpisodeAborted as error:  # the env-server is fine: it stays in the pool
                lost.append((backend.address, error))
                raise
            except EnvServerLost as error:
                self.pool.report_lost(backend, error)
                lost.append((backend.address, error))
                raise
            finally:
                await self.pool.close_left()  # servers that left, once idle

        def restarting(error: BaseException, attempt: int) -> None:
            self.restarts += 1
            why = "aborted" if isinstance(error, EpisodeAborted) else "lost"
            COUNTERS.inc("orchestrator_episode_restarts", env_id=spec.env_id, why=why)
            log.warning(
                "episode restarts from its seed",
                extra={
                    "task_id": task.task_id,
                    why: lost[-1][0],
                    "attempt": attempt,
                    "error": str(lost[-1][1]),
                },
            )

        try:
            # No pause: another backend is tried at once; the lost one is out of the pool.
            return await call_with_retries(
                on_some_backend,
                RetryPolicy(attempts=attempts, first_pause=0.0, max_pause=0.0),
                what=f"episode {task.task_id}/{sample_index}",
                retryable=lambda error: isinstance(error, EnvServerLost),
                on_retry=restarting,
            )
        except EnvServerLost:
            address, error = lost[-1]
            what = "aborted" if isinstance(error, EpisodeAborted) else "env-servers lost"
            raise EpisodeFailed(
                f"episode {task.task_id}/{sample_index}: {what} {attempts} times; "
                f"last: {address}: {error}"
            ) from None

    async def _run_on(
        self,
        backend: EnvBackend,
        spec: EnvSpec,
        task: Task,
        sample_index: int,
        temperature: float,
    ) -> Trajectory:
        settings = self.settings
        timings = {"generate": 0.0, "env": 0.0, "score": 0.0}
        started = time.perf_counter()
        try:
            session_id, observation, info = await backend.reset(
                spec.env_id,
                task.metadata.get("env_seed"),
                dict(task.metadata.get("env_kwargs", {})),
            )
        except EnvServerLost:
            raise
        except EnvCallError as error:
            if error.code == "DEADLINE_EXCEEDED":
                raise EnvServerLost(f"{backend.address} did not answer Reset: {error}") from None
            if error.code == "ABORTED":
                raise EpisodeAborted(f"{backend.address}: {error.message}") from None
            raise EpisodeFailed(f"env {spec.env_id!r} on {backend.address}: {error}") from None
        timings["env"] += time.perf_counter() - started
        turns = self._turns()
        tokens = EpisodeTokens()
        step_rewards: list[float] = []
        turn_keys: list[str] = []
        first_observation, action_text, finish_reason = parts(observation)[0], "", "truncated"
        stopped = False
        components: dict[str, float] = {}
        try:
            tools = offered_tools(info)
            tokens.context(*self._shown(spec, backend, turns.first, observation, tools))
            for turn in range(settings.max_turns):
                budget = min(self.max_new_tokens, settings.max_episode_tokens - len(tokens.ids))
                if budget < 1:
                    finish_reason = "length"
                    break
                turn_keys.append(self._key(info, tokens.ids))
                clock = time.perf_counter()
                output = await self.generate(tokens.ids, budget, temperature, tokens.images)
                timings["generate"] += time.perf_counter() - clock
                tokens.generated(output, turn)
                action_ids = list(output.token_ids)
                stopped = bool(action_ids) and action_ids[-1] == self.eos
                action_text = self.decode(action_ids)
                clock = time.perf_counter()
                try:
                    observation, reward, terminated, truncated, info = await backend.step(
                        session_id, action_text
                    )
                except EnvServerLost:
                    raise
                except EnvCallError as error:
                    if error.code == "ABORTED":  # a tool server it used was lost
                        raise EpisodeAborted(f"{backend.address}: {error.message}") from None
                    if error.code in ("NOT_FOUND", "DEADLINE_EXCEEDED"):
                        # The server forgot the session (restarted, or expired it) or hangs:
                        # start over elsewhere.
                        raise EnvServerLost(f"{backend.address}: {error}") from None
                    if error.code != "INVALID_ARGUMENT":
                        raise EpisodeFailed(
                            f"env {spec.env_id!r} on {backend.address}: {error}"
                        ) from None
                    COUNTERS.inc("orchestrator_invalid_actions", env_id=spec.env_id)
                    reward, info = settings.invalid_action_reward, {}
                    terminated = settings.invalid_action == "end"
                    truncated = False
                    observation = f"invalid action: {error.message}"
                    if terminated:
                        finish_reason = "invalid"
                finally:
                    timings["env"] += time.perf_counter() - clock
                step_rewards.append(float(reward))
                if terminated or truncated:
                    if finish_reason != "invalid":
                        finish_reason = "terminated" if terminated else "truncated"
                    break
                role = str(info.get("observation_role", "user"))
                following, shown = self._shown(
                    spec, backend, turns.then, action_text, stopped, observation, role
                )
                if len(tokens.ids) + len(following) + 1 > settings.max_episode_tokens:
                    finish_reason = "length"
                    break
                tokens.context(following, shown)
            if settings.check_token_drift and not tokens.images and tokens.ids:
                self._check_drift(spec, turns, action_text, stopped, tokens.ids)
            if not spec.gives_reward:
                clock = time.perf_counter()
                reward, components = await self.score(spec, first_observation, action_text, info)
                timings["score"] += time.perf_counter() - clock
                if step_rewards:
                    step_rewards[-1] += reward
                else:
                    step_rewards.append(reward)
        finally:
            try:
                await backend.close(session_id)
            except EnvCallError as error:  # the episode is over either way
                log.debug("closing a session failed: %s", error)
        timings["total"] = time.perf_counter() - started
        return trajectory_from_episode(
            task,
            sample_index,
            tokens,
            source=spec.env_id,
            domain=spec.domain,
            reward=float(sum(step_rewards)),
            reward_components={**components, "turns": float(len(step_rewards))},
            finish_reason=finish_reason,
            timings=timings,
            step_rewards=step_rewards,
            turn_keys=turn_keys,
        )

    def _check_drift(
        self,
        spec: EnvSpec,
        turns: PlainTurns | ChatTurns,
        action_text: str,
        stopped: bool,
        ids: list[int],
    ) -> None:
        """Counts and logs an episode whose tokens are not its conversation tokenised again."""
        transcript = turns.transcript(action_text, stopped)
        at = token_drift(self.tokenizer, transcript, ids)
        if at is None:
            return
        self.drifts += 1
        COUNTERS.inc("orchestrator_token_drift", env_id=spec.env_id)
        if self.drifts in (1, 10, 100) or self.drifts % 1000 == 0:
            again = list(self.tokenizer(transcript, add_special_tokens=False)["input_ids"])
            log.warning(
                "an episode's tokens differ from its conversation tokenised again "
                "(counted as orchestrator_token_drift)",
                extra={
                    "env_id": spec.env_id,
                    "episodes_so_far": self.drifts,
                    "at_token": at,
                    "episode": self.tokenizer.decode(ids[max(0, at - 8) : at + 8]),
                    "tokenised_again": self.tokenizer.decode(again[max(0, at - 8) : at + 8]),
                },
            )

    @staticmethod
    def _shown(
        spec: EnvSpec, backend: EnvBackend, render: Callable[..., Shown], *args: Any
    ) -> Shown:
        """An observation rendered as tokens (`render`: the turns' first or then); an image
        the policy cannot be shown (not a vision-language model, or refused by
        image_inputs) fails the episode, saying which env sent it."""
        try:
            return render(*args)
        except ImageError as error:
            COUNTERS.inc("orchestrator_refused_images", env_id=spec.env_id)
            raise EpisodeFailed(
                f"env {spec.env_id!r} on {backend.address} sent an image the policy cannot "
                f"be shown: {error}"
            ) from None

    def _key(self, info: dict[str, Any], context: list[int]) -> str:
        """The state a turn acts in: the env's `state_key` when it gives one, else everything
        the policy has seen (so turns share a key only when their contexts are equal)."""
        if "state_key" in info:
            return str(info["state_key"])
        digest = hashlib.blake2b(np.asarray(context, np.int32).tobytes(), digest_size=12)
        return digest.hexdigest()
