"""A conformance suite for any server of `rollwire.v1.EnvService`, in any language.

    report = await run_checks("127.0.0.1:50051", CheckOptions(env_id="guess_the_number"))
    report.passed, report.result("step_contract").outcome

An environment plugs into rollwire by serving proto/v1/env.proto; this suite is
how its author learns whether it honours the contract before a training run
depends on it. Every check returns a `CheckResult` instead of raising, so a
test can assert on one check and a person sees them all at once.

Outcomes: `pass`; `fail` (the contract is broken); `warn` (allowed, but likely
not what was meant); `skip` (could not be judged, with the reason). Only `fail`
makes the suite fail. Every failure's detail ends with the section of
docs/env-servers.md that states the rule it broke.

The suite cannot know which actions an unknown env accepts, so it steps with
candidate actions (`CheckOptions.actions`). An INVALID_ARGUMENT reply is valid
behaviour wherever a check is about the protocol (the env may reject "left"),
and takes part in determinism comparisons like any other reply.

A seed-independent env (every seed gives the same episode) gets a `warn`, not a
`fail`: the contract only promises that the same seed gives the same episode,
and a fixed puzzle is a legitimate environment, but an env meant to vary that
ignores its seed trains on one episode, which deserves a loud note.

When Reset of the env refuses the kwargs (INVALID_ARGUMENT), the first check to
reset fails saying so and the later ones that need a session skip, rather than
repeat one cause a dozen times. The session limit and idle expiry are not
checked: neither can be seen without knowing the server's settings or waiting.

The calls the checks make, their options and verdicts live in `check_probe`,
the Multiplex check in `check_multiplex`; this module runs them and reports.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import grpc
import grpc.aio

from rollwire.envs.base import offered_tools
from rollwire.envs.check_multiplex import MultiplexCheck
from rollwire.envs.check_probe import (
    DEFAULT_ACTIONS,
    UNKNOWN_ENV_ID,
    CheckFailed,
    CheckOptions,
    CheckSkipped,
    CheckWarning,
    Probe,
    Reply,
)
from rollwire.proto.v1 import env_pb2
from rollwire.services.core.client import check_health, describe_error, open_channel
from rollwire.services.core.config import ClientConfig
from rollwire.services.core.structs import to_struct

__all__ = [
    "CHECKS",
    "DEFAULT_ACTIONS",
    "CheckFailed",
    "CheckOptions",
    "CheckReport",
    "CheckResult",
    "CheckSkipped",
    "CheckWarning",
    "ServerUnreachable",
    "format_table",
    "run_checks",
]

Outcome = Literal["pass", "fail", "warn", "skip"]
ENV_SERVICE = "rollwire.v1.EnvService"
SEED_VARIATION_SEEDS = tuple(range(2, 8))  # with seeds 0 and 1 from the determinism check
BAD_KWARG = "rollwire_env_check_no_such_kwarg"
GUIDE = "docs/env-servers.md"
"""The page a failure points to, for the rule it broke."""
SECTIONS = {
    "health": "what-a-server-serves",
    "list_envs": "listenvs",
    "reset_determinism": "seeds-and-determinism",
    "seed_variation": "seeds-and-determinism",
    "step_contract": "step",
    "unknown_env": "reset",
    "unknown_session": "step",
    "bad_kwargs": "reset",
    "oversized_action": "step",
    "close_unknown": "close",
    "concurrent_sessions": "sessions",
    "multiplex": "multiplex",
    "still_serving": "what-a-server-serves",
}
"""The section of `GUIDE` each check's failures point to when their message names none."""


def see(section: str) -> str:
    """The pointer a failure message ends with: " (see docs/env-servers.md#section)"."""
    return f" (see {GUIDE}#{section})"


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict; `detail` says what was seen, in a line a person can act on."""

    name: str
    outcome: Outcome
    detail: str
    duration_ms: float


@dataclass(frozen=True)
class CheckReport:
    """Every check run against one server, in order."""

    address: str
    env_id: str | None
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        """True when no check failed (warnings and skips do not fail the suite)."""
        return all(result.outcome != "fail" for result in self.results)

    def result(self, name: str) -> CheckResult:
        """The result of the check called `name`."""
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r}; ran: {[r.name for r in self.results]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary, what `rollwire env-check --json` prints."""
        return {
            "address": self.address,
            "env_id": self.env_id,
            "passed": self.passed,
            "results": [asdict(result) for result in self.results],
        }


class ServerUnreachable(Exception):
    """Nothing answers at the address; no check could run."""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


class _Suite(Probe):
    """The checks, each a method, sharing one `Probe` of the server."""

    async def health(self) -> str:
        try:
            status = await check_health(self.channel, "", timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(
                f"grpc.health.v1 Check of service '' failed: {describe_error(error)}; "
                f"expected SERVING{see('what-a-server-serves')}"
            ) from None
        if status != "SERVING":
            raise CheckFailed(
                f"the server reports {status}, not SERVING, for service '' (the whole server)"
                f"{see('what-a-server-serves')}"
            )
        try:
            named = await check_health(self.channel, ENV_SERVICE, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND:
                return "SERVING ('' only; no per-service status for EnvService)"
            raise CheckFailed(
                f"health of {ENV_SERVICE}: {describe_error(error)}; expected SERVING, or "
                f"NOT_FOUND when the name is not registered{see('what-a-server-serves')}"
            ) from None
        if named != "SERVING":
            raise CheckFailed(
                f"the server is SERVING but reports {ENV_SERVICE} as {named}; expected SERVING"
                f"{see('what-a-server-serves')}"
            )
        return f"SERVING ('' and {ENV_SERVICE})"

    async def list_envs(self) -> str:
        try:
            reply = await self.stub.ListEnvs(env_pb2.ListEnvsRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(
                f"ListEnvs failed: {describe_error(error)}{see('listenvs')}"
            ) from None
        ids = [spec.env_id for spec in reply.envs]
        if not ids:
            raise CheckFailed(
                f"ListEnvs named no environment; expected at least one{see('listenvs')}"
            )
        problems = [f"an env with an empty env_id (#{i})" for i, e in enumerate(ids) if not e]
        problems += [f"{e!r} listed twice" for e in sorted({e for e in ids if ids.count(e) > 1})]
        problems += [f"{e!r} has whitespace in its id" for e in ids if e != "".join(e.split())]
        problems += [f"{s.env_id!r} has no domain" for s in reply.envs if not s.domain]
        if self.env_id is not None and self.env_id not in ids:
            problems.append(f"--env-id {self.env_id!r} is not among them")
        if self.env_id is None and ids[0]:
            self.env_id = ids[0]
        if problems:
            raise CheckFailed("; ".join(problems) + see("listenvs"))
        if undescribed := [s.env_id for s in reply.envs if not s.description]:
            raise CheckWarning(f"{len(ids)} env(s); no description for {undescribed}")
        return f"{len(ids)} env(s): {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"

    async def reset_determinism(self) -> str:
        """Two sessions per seed, stepped alternately: the same seed must give the same replies."""
        self.need_env()
        for seed in (0, 1):
            first_id, first = await self.reset(seed)
            second_id = ""
            try:
                second_id, second = await self.reset(seed)
                if first != second:
                    raise CheckFailed(
                        f"seed {seed}: two Resets differ: {first.brief()} {first.info} vs "
                        f"{second.brief()} {second.info}; the same env id, kwargs and seed "
                        f"must give the same observation and info{see('seeds-and-determinism')}"
                    )
                transcript = [first]
                for action in self.options.actions:
                    one = await self.step(first_id, action)
                    two = await self.step(second_id, action)
                    if one != two:
                        raise CheckFailed(
                            f"seed {seed}, step {len(transcript)} (action {action!r}): "
                            f"{one.brief()} {one.info} vs {two.brief()} {two.info}; the same "
                            "seed and actions must give the same replies"
                            f"{see('seeds-and-determinism')}"
                        )
                    transcript.append(one)
                    if one.done:
                        break
            finally:
                for session_id in filter(None, (first_id, second_id)):
                    await self.close(session_id)
            self.transcripts[seed] = transcript
        steps = len(self.transcripts[0]) - 1
        rejected = sum(r.code != "OK" for r in self.transcripts[0])
        return f"seeds 0 and 1 replayed identically ({_count(steps, 'step')}, {rejected} rejected)"

    async def seed_variation(self) -> str:
        if len(self.transcripts) < 2:
            raise CheckSkipped("needs reset_determinism to pass first")
        for seed in SEED_VARIATION_SEEDS:
            self.transcripts[seed] = await self.play_alone(seed)
        seeds = sorted(self.transcripts)
        distinct = {repr(self.transcripts[seed]) for seed in seeds}
        if len(distinct) == 1:
            raise CheckWarning(
                f"seeds {seeds[0]}..{seeds[-1]} all gave the same episode for these actions; "
                "fine for a fixed env, wrong if it should vary by seed (try --action)"
            )
        return f"{len(distinct)} distinct episodes over seeds {seeds[0]}..{seeds[-1]}"

    async def image_observations(self) -> str:
        """Every image the observations showed so far opens as the orchestrator opens it."""
        if not self.images:
            raise CheckSkipped("no observation showed an image")
        try:
            from rollwire.services.core.images import ImageError, ImageLimits, of_protos, open_image

            limits = ImageLimits()
            opened = [open_image(ref, limits) for ref in of_protos(self.images.values())]
        except ImportError as error:
            raise CheckSkipped(
                f"images are opened with Pillow, which is missing: {error}"
            ) from None
        except ImageError as error:
            raise CheckFailed(
                f"an observation's image does not open: {error}{see('image-observations')}"
            ) from None
        sizes = sorted({f"{image.width}x{image.height}" for image in opened})
        return f"{_count(len(opened), 'distinct image')} opened ({', '.join(sizes)} pixels)"

    async def tool_calls(self) -> str:
        """An env that offers tools (`info["tools"]`, as the `mcp` envs do): they read as
        function schemas, and a malformed call and a call to a tool it does not offer are
        answered with an observation, not refused and not the end of the episode."""
        session_id, first = await self.reset(seed=0)
        try:
            if "tools" not in first.info:
                raise CheckSkipped("the env offers no tools (no info['tools'] at Reset)")
            tools = offered_tools(first.info)
            if tools is None:
                raise CheckFailed(
                    "info['tools'] is not JSON text of a non-empty list of tool schemas"
                    f"{see('tools')}"
                )
            names = []
            for tool in tools:
                function = tool.get("function", {}) if isinstance(tool, dict) else {}
                if not isinstance(function.get("name"), str) or not isinstance(
                    function.get("parameters", {}), dict
                ):
                    raise CheckFailed(
                        f"a tool is not {{'type': 'function', 'function': {{'name', "
                        f"'parameters'}}}}: {str(tool)[:120]}{see('tools')}"
                    )
                names.append(function["name"])
            unknown = f"no_such_tool_{uuid.uuid4().hex[:6]}"
            for action, what in (
                ('<tool_call>{"name": </tool_call>', "a malformed tool call"),
                (f'<tool_call>{{"name": "{unknown}", "arguments": {{}}}}</tool_call>',
                 "a call to a tool it does not offer"),
            ):  # fmt: skip
                reply = await self.step(session_id, action)
                if reply.code != "OK" or reply.done or not reply.observation.strip():
                    how = (
                        f"refused ({reply.code})" if reply.code != "OK"
                        else "ended the episode" if reply.done else "answered with nothing"
                    )  # fmt: skip
                    raise CheckFailed(
                        f"{what} was {how}: it must be an observation the policy learns from"
                        f"{see('tools')}"
                    )
        finally:
            await self.close(session_id)
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        return (
            f"{_count(len(names), 'tool')} offered ({shown}); a malformed call and an unknown "
            "tool were answered as observations"
        )

    async def step_contract(self) -> str:
        session_id, _ = await self.reset(seed=0)
        closed = False
        try:
            steps = rejected = 0
            reply = Reply("INVALID_ARGUMENT")
            while steps < self.options.max_steps and not reply.done:
                action = self.options.actions[steps % len(self.options.actions)]
                reply = await self.step(session_id, action)
                steps += 1
                rejected += reply.code != "OK"
                if rejected == steps == len(self.options.actions):
                    raise CheckSkipped(
                        f"all {steps} candidate actions were rejected (INVALID_ARGUMENT); "
                        "pass --action with one this env accepts"
                    )
            if not reply.done:
                raise CheckWarning(
                    f"no episode end within {steps} steps, so step-after-done was not checked; "
                    "pass --action values that finish an episode"
                )
            how = "terminated" if reply.terminated else "truncated"
            action = self.accepted_action or ""
            await self.expect_error(
                self.raw_step(session_id, action),
                [grpc.StatusCode.FAILED_PRECONDITION],
                f"Step after the episode {how}",
            )
            if not await self.close(session_id):
                raise CheckFailed(
                    "Close of a finished but open session answered existed=false; expected "
                    f"existed=true: a finished session stays open until Close{see('close')}"
                )
            closed = True
            await self.expect_error(
                self.raw_step(session_id, action),
                [grpc.StatusCode.NOT_FOUND],
                "Step on a closed session",
            )
            if await self.close(session_id):
                raise CheckFailed(
                    "a second Close of the same session answered existed=true; expected "
                    f"existed=false{see('close')}"
                )
        finally:
            if not closed:
                await self.close(session_id)
        return (
            f"{_count(steps, 'step')} ({rejected} rejected), {how} with reward {reply.reward:g}; "
            "after done FAILED_PRECONDITION; after Close NOT_FOUND"
        )

    async def unknown_env(self) -> str:
        request = env_pb2.ResetRequest(env_id=UNKNOWN_ENV_ID, seed=0)
        try:
            reply = await self.stub.Reset(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND:
                return "NOT_FOUND"
            raise CheckFailed(
                f"Reset of env id {UNKNOWN_ENV_ID!r}: expected NOT_FOUND, got "
                f"{describe_error(error)}{see('reset')}"
            ) from None
        await self.close(reply.session_id)
        raise CheckFailed(
            f"Reset of env id {UNKNOWN_ENV_ID!r} succeeded; expected NOT_FOUND{see('reset')}"
        )

    async def unknown_session(self) -> str:
        step = self.raw_step(uuid.uuid4().hex, self.options.actions[0])
        await self.expect_error(step, [grpc.StatusCode.NOT_FOUND], "Step on an unknown session")
        return "NOT_FOUND"

    async def bad_kwargs(self) -> str:
        request = env_pb2.ResetRequest(env_id=self.need_env(), seed=0)
        request.env_kwargs.CopyFrom(to_struct({BAD_KWARG: 1}))
        try:
            reply = await self.stub.Reset(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.INVALID_ARGUMENT:
                return "INVALID_ARGUMENT for an unknown kwarg"
            raise CheckFailed(
                f"an unknown kwarg ({BAD_KWARG!r}): expected INVALID_ARGUMENT, got "
                f"{describe_error(error)}{see('reset')}"
            ) from None
        await self.close(reply.session_id)
        raise CheckWarning("an unknown kwarg was accepted; fine only if the env ignores extras")

    async def oversized_action(self) -> str:
        session_id, _ = await self.reset(seed=0)
        try:
            size = self.options.oversized_action_bytes
            # A valid action at the end: a server with no size limit would accept it.
            tail = " " + (self.accepted_action or self.options.actions[0])
            action = "x" * max(size - len(tail.encode()), 0) + tail
            code = await self.expect_error(
                self.raw_step(session_id, action),
                [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT],
                f"an action of {size} bytes (more than any sensible action size limit)",
            )
            # Refusing it must leave the session as it was: a lost session fails here.
            try:
                after = await self.step(session_id, tail.strip())
            except CheckFailed as error:
                raise CheckFailed(
                    f"after refusing an action of {size} bytes the session must live on: {error}"
                ) from None
        finally:
            await self.close(session_id)
        return f"{code.name} for {size} bytes; the session lived on ({after.code})"

    async def close_unknown(self) -> str:
        if await self.close(uuid.uuid4().hex):
            raise CheckFailed(
                "Close of a session id never issued answered existed=true; expected "
                f"existed=false{see('close')}"
            )
        return "existed=false"

    async def concurrent_sessions(self) -> str:
        """Many sessions stepped at once must each replay what one session alone does."""
        references = {seed: self.transcripts[seed] for seed in (0, 1) if seed in self.transcripts}
        if len(references) < 2:
            raise CheckSkipped("needs reset_determinism to pass first: it gives the reference")
        count = self.options.sessions
        seeds = [index % 2 for index in range(count)]
        opened = await asyncio.gather(*(self.reset(seed) for seed in seeds), return_exceptions=True)
        ids = [item[0] for item in opened if isinstance(item, tuple)]
        try:
            if failure := next((item for item in opened if isinstance(item, Exception)), None):
                raise failure
            if len(set(ids)) != count:
                raise CheckFailed(
                    f"{count} Resets gave only {len(set(ids))} distinct session ids; expected "
                    f"{count}, one per session{see('sessions')}"
                )
            transcripts = [[reply] for _, reply in opened]  # type: ignore[misc]
            order = random.Random(0)
            for action in self.options.actions:
                live = [i for i in range(count) if not transcripts[i][-1].done]
                if not live:
                    break
                order.shuffle(live)
                replies = await asyncio.gather(*(self.step(ids[i], action) for i in live))
                for index, reply in zip(live, replies, strict=True):
                    transcripts[index].append(reply)
            for index, transcript in enumerate(transcripts):
                expected = references[seeds[index]]
                if transcript != expected:
                    at = next(
                        (
                            i
                            for i, (a, b) in enumerate(zip(transcript, expected, strict=False))
                            if a != b
                        ),
                        min(len(transcript), len(expected)),
                    )
                    got = transcript[at].brief() if at < len(transcript) else "nothing"
                    want = expected[at].brief() if at < len(expected) else "nothing"
                    raise CheckFailed(
                        f"session {index} of {count} (seed {seeds[index]}) differs from the same "
                        f"seed played without company at reply {at}: {got} vs {want}; sessions "
                        f"must not affect each other{see('sessions')}"
                    )
        finally:
            closed = await asyncio.gather(*(self.close(sid) for sid in ids))
        if not all(closed):
            raise CheckFailed(
                f"{closed.count(False)} of {count} open sessions were unknown to Close; "
                f"expected existed=true for each{see('sessions')}"
            )
        return f"{count} interleaved sessions each replayed their seed's episode exactly"

    async def multiplex(self) -> str:
        return await MultiplexCheck(self).run()

    async def still_serving(self) -> str:
        detail = await self.health()
        try:
            await self.stub.ListEnvs(env_pb2.ListEnvsRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(
                f"ListEnvs after the bad input: {describe_error(error)}; a server must keep "
                f"serving through bad input{see('what-a-server-serves')}"
            ) from None
        return f"{detail.split(' ', 1)[0]} and answering after all the bad input"


CHECKS: tuple[tuple[str, Callable[[_Suite], Awaitable[str]]], ...] = (
    ("health", _Suite.health),
    ("list_envs", _Suite.list_envs),
    ("reset_determinism", _Suite.reset_determinism),
    ("seed_variation", _Suite.seed_variation),
    ("step_contract", _Suite.step_contract),
    ("image_observations", _Suite.image_observations),
    ("tool_calls", _Suite.tool_calls),
    ("unknown_env", _Suite.unknown_env),
    ("unknown_session", _Suite.unknown_session),
    ("bad_kwargs", _Suite.bad_kwargs),
    ("oversized_action", _Suite.oversized_action),
    ("close_unknown", _Suite.close_unknown),
    ("concurrent_sessions", _Suite.concurrent_sessions),
    ("multiplex", _Suite.multiplex),
    ("still_serving", _Suite.still_serving),
)
"""Every check, in the order it runs; later ones reuse what earlier ones learned."""


async def _run_one(name: str, check: Callable[[], Awaitable[str]], timeout: float) -> CheckResult:
    started = time.perf_counter()
    outcome: Outcome
    try:
        outcome, detail = "pass", await check()
    except CheckFailed as error:
        outcome, detail = "fail", str(error)
    except CheckWarning as error:
        outcome, detail = "warn", str(error)
    except CheckSkipped as error:
        outcome, detail = "skip", str(error)
    except grpc.aio.AioRpcError as error:
        outcome, detail = "fail", describe_error(error)
    except TimeoutError:
        outcome, detail = (
            "fail",
            f"a call or read ran past its deadline of {timeout:g}s (--timeout)",
        )
    except Exception as error:  # a check must report, never take the suite down
        outcome, detail = "fail", f"the check itself failed: {type(error).__name__}: {error}"
    if outcome == "fail" and f"(see {GUIDE}#" not in detail:
        detail += see(SECTIONS.get(name, "checking-a-server"))
    return CheckResult(name, outcome, detail, (time.perf_counter() - started) * 1000)


async def run_checks(
    address: str, options: CheckOptions | None = None, client: ClientConfig | None = None
) -> CheckReport:
    """Runs every check against the EnvService at `address`.

    Raises:
        ServerUnreachable: nothing answered at `address` within `options.timeout`.
    """
    options = options or CheckOptions()
    if not options.actions:
        raise ValueError("CheckOptions.actions needs at least one candidate action")
    async with open_channel(address, client) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), options.timeout)
        except TimeoutError:
            raise ServerUnreachable(
                f"cannot connect to {address} within {options.timeout:g}s"
            ) from None
        suite = _Suite(channel, options, (client or ClientConfig()).auth.resolve_token())
        results = []
        for name, check in CHECKS:
            results.append(await _run_one(name, lambda check=check: check(suite), options.timeout))
        return CheckReport(address, suite.env_id, results)


def format_table(report: CheckReport) -> str:
    """The report as an aligned text table (check, result, detail, ms) and a summary line."""
    header = ("check", "result", "detail", "ms")
    rows = [(r.name, r.outcome.upper(), r.detail, f"{r.duration_ms:.0f}") for r in report.results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = [
        f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>5}"
        for row in [header, *rows]
    ]
    counts = {
        o: sum(r.outcome == o for r in report.results) for o in ("pass", "fail", "warn", "skip")
    }
    verdict = "PASSED" if report.passed else "FAILED"
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    lines.append(f"{report.address} (env {report.env_id}): {verdict}: {summary}")
    return "\n".join(lines)
