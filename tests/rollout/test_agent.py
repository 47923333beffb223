"""Multi-turn episodes: turns as tokens, loss masks, restarts on a lost env-server, the pool."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from rollwire.envs.base import EnvSpec
from rollwire.envs.client import EnvServerLost, LocalEnvs
from rollwire.envs.demos import demo_batches, demonstrator
from rollwire.envs.host import EnvCallError
from rollwire.envs.pool import EnvPool
from rollwire.proto.v1 import rollout_pb2
from rollwire.rollout.orchestrator.agent import ChatTurns, EpisodeFailed, EpisodeRunner, PlainTurns
from rollwire.services.core.config import AgentConfig, EnvDataset, EnvServerConfig
from rollwire.services.core.datasets import EnvTasks
from rollwire.services.core.members import expand_addresses

CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]\n{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from rollwire.services.core.tiny import build_tokenizer

    return build_tokenizer()


class ScriptedPolicy:
    """Stands in for the rollout-server: answers each turn with the next scripted text."""

    def __init__(self, tokenizer: Any, actions: list[str], version: int = 3) -> None:
        self.tokenizer, self.actions, self.version = tokenizer, list(actions), version
        self.prompts: list[list[int]] = []
        self.images: list[list] = []

    async def __call__(
        self, prompt: list[int], max_new_tokens: int, temperature: float, images: list = ()
    ) -> rollout_pb2.GenerateResponse:
        self.prompts.append(list(prompt))
        self.images.append(list(images))
        text = self.actions.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id][:max_new_tokens]
        return rollout_pb2.GenerateResponse(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            policy_versions=[self.version] * len(ids),
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
        )


async def no_scorer(*args: Any) -> tuple[float, dict[str, float]]:
    raise AssertionError("this env gives its own rewards")


def runner(
    tokenizer: Any,
    pool: EnvPool,
    specs: dict[str, EnvSpec],
    policy: Any,
    score: Any = no_scorer,
    **settings: Any,
) -> EpisodeRunner:
    return EpisodeRunner(pool, specs, tokenizer, AgentConfig(**settings), 16, False, policy, score)


def guess_task(seed: int = 7, **kwargs: Any):
    return EnvTasks(
        EnvDataset(env_id="guess_the_number", env_kwargs={"low": 1, "high": 8, **kwargs}, seed=seed)
    )[0]


def target_of(seed: int) -> int:
    from rollwire.envs.registry import make

    for guess in range(1, 9):
        env = make("guess_the_number", low=1, high=8, max_turns=10)
        env.reset(seed)
        if env.step(str(guess))[2]:
            return guess
    raise AssertionError("no target found")


def run(coroutine):
    return asyncio.run(coroutine)


def test_plain_turns_and_loss_mask_cover_only_generated_tokens(tokenizer) -> None:
    target = target_of(7)
    wrong = 1 if target != 1 else 2
    policy = ScriptedPolicy(tokenizer, [str(wrong), str(target)])
    pool = EnvPool([LocalEnvs(EnvServerConfig())])

    async def go():
        specs = await pool.specs()
        return await runner(tokenizer, pool, specs, policy).run(guess_task(), 0, 1.0)

    trajectory = run(go())
    ids, mask = trajectory.token_ids.tolist(), trajectory.loss_mask.tolist()
    generated = [t for t, m in zip(ids, mask, strict=True) if m == 1]
    eos = tokenizer.eos_token_id
    assert generated == [
        *tokenizer(str(wrong))["input_ids"],
        eos,
        *tokenizer(str(target))["input_ids"],
        eos,
    ]
    text = tokenizer.decode(ids)
    hint = "higher" if wrong < target else "lower"
    assert f"{hint}\n" in text and text.startswith("I am thinking of an integer between 1 and 8")
    # The observation between the turns is context, never trained on.
    hint_ids = tokenizer(hint, add_special_tokens=False)["input_ids"]
    hint_at = next(i for i in range(len(ids)) if ids[i : i + len(hint_ids)] == hint_ids)
    assert set(mask[hint_at : hint_at + len(hint_ids)]) == {0}
    assert trajectory.step_rewards.tolist() == [0.0, 1.0] and trajectory.reward == 1.0
    assert trajectory.finish_reason == "terminated"
    turns = trajectory.turn_ids
    assert set(turns[trajectory.loss_mask == 1].tolist()) == {0, 1}
    assert set(turns[trajectory.loss_mask == 0].tolist()) == {-1}
    assert len(trajectory.turn_keys) == 2 and trajectory.turn_keys[0] != trajectory.turn_keys[1]
    assert np.all(trajectory.policy_versions[trajectory.loss_mask == 1] == 3)
    assert np.all(trajectory.behaviour_logprobs[trajectory.loss_mask == 0] == 0)
    # The second turn was generated from exactly the tokens of the episode so far.
    assert policy.prompts[1] == ids[: len(policy.prompts[1])]
    assert trajectory.group_id == "guess_the_number/7" and trajectory.source == "guess_the_number"


def test_chat_turns_build_exactly_what_the_template_renders() -> None:
    from rollwire.services.core.tiny import build_tokenizer

    chat = build_tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    turns = ChatTurns(chat, system_prompt="Play well.")
    ids, images = turns.first("guess")
    for action, observation in [("5", "higher"), ("7", "lower")]:
        ids += chat(action, add_special_tokens=False)["input_ids"] + [chat.eos_token_id]
        following, shown = turns.then(action, True, observation)
        ids += following
        images += shown
    assert images == []
    messages = [
        {"role": "system", "content": "Play well."},
        {"role": "user", "content": "guess"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "lower"},
    ]
    rendered = chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == chat(rendered, add_special_tokens=False)["input_ids"]
    plain = PlainTurns(chat, "> {observation}\n")
    assert chat.decode(plain.first("hi")[0]) == "> hi\n"


async def test_a_chat_formatted_prompt_is_exactly_what_the_template_renders(tmp_path) -> None:
    """`orchestrator.use_chat_template`: the prompt's tokens are the rendered template's,
    not the keys of the mapping transformers 5 returns from apply_chat_template."""
    from rollwire.rollout.orchestrator.sampler import Sampler
    from rollwire.services.core.config import RunConfig
    from rollwire.services.core.datasets import Task
    from rollwire.services.core.tiny import build_tokenizer

    chat = build_tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    config = RunConfig.model_validate(
        {
            "run": {"output_dir": str(tmp_path)},
            "orchestrator": {"use_chat_template": True, "prompt_template": "Q: {question}"},
            # Never called: channels connect only when used.
            "endpoints": {"rollout_servers": ["127.0.0.1:9"], "reward_servers": ["127.0.0.1:9"]},
        }
    )
    ids = Sampler(config, chat).encode_prompt(Task(0, "t0", "What is 1 + 2?", "3", "math", "test"))
    rendered = chat.apply_chat_template(
        [{"role": "user", "content": "Q: What is 1 + 2?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == "[user]\nQ: What is 1 + 2?<eos>\n[assistant]\n"
    assert ids == chat(rendered, add_special_tokens=False)["input_ids"]


def test_invalid_actions_feedback_or_end(tokenizer) -> None:
    pool = EnvPool([LocalEnvs(EnvServerConfig())])

    async def go(mode: str, actions: list[str]):
        specs = await pool.specs()
        episode = runner(
            tokenizer,
            pool,
            specs,
            ScriptedPolicy(tokenizer, actions),
            invalid_action=mode,
            invalid_action_reward=-0.5,
        )
        return await episode.run(guess_task(), 0, 1.0)

    ended = run(go("end", ["no number"]))
    assert ended.finish_reason == "invalid" and ended.reward == -0.5
    target = target_of(7)
    fed_back = run(go("feedback", ["no number", str(target)]))
    assert fed_back.step_rewards.tolist() == [-0.5, 1.0]
    assert "invalid action: " in tokenizer.decode(fed_back.token_ids.tolist())


def test_turn_and_token_limits_truncate(tokenizer) -> None:
    pool = EnvPool([LocalEnvs(EnvServerConfig())])

    async def go(**settings: Any):
        specs = await pool.specs()
        target = target_of(7)
        wrong = "1" if target != 1 else "2"
        return await runner(
            tokenizer, pool, specs, ScriptedPolicy(tokenizer, [wrong] * 10), **settings
        ).run(guess_task(), 0, 1.0)

    by_turns = run(go(max_turns=3))
    assert len(by_turns.step_rewards) == 3 and by_turns.finish_reason == "truncated"
    by_tokens = run(go(max_episode_tokens=100))
    assert by_tokens.finish_reason == "length" and by_tokens.num_tokens <= 100


class FlakyBackend(LocalEnvs):
    """In-process envs that lose the connection after `steps_before_loss` steps."""

    def __init__(self, steps_before_loss: int, address: str) -> None:
        super().__init__(EnvServerConfig())
        self.address = address
        self.steps_left = steps_before_loss
        self.resets: list[int | None] = []

    async def reset(self, env_id: str, seed: int | None = None, kwargs: dict | None = None):
        self.resets.append(seed)
        return await super().reset(env_id, seed, kwargs)

    async def step(self, session_id: str, action: str):
        if self.steps_left == 0:
            raise EnvServerLost("connection reset")
        self.steps_left -= 1
        return await super().step(session_id, action)


def test_lost_server_restarts_the_episode_from_its_seed_elsewhere(tokenizer) -> None:
    flaky, steady = FlakyBackend(1, "flaky:1"), FlakyBackend(-1, "steady:1")
    pool = EnvPool([flaky, steady], retry_after_seconds=60)
    target = target_of(7)
    wrong = "1" if target != 1 else "2"
    # Turn 1 on the flaky server succeeds, turn 2 is lost; the episode restarts on the other.
    policy = ScriptedPolicy(tokenizer, [wrong, str(target), wrong, str(target)])

    async def go():
        specs = await pool.specs()
        episodes = runner(tokenizer, pool, specs, policy)
        return episodes, await episodes.run(guess_task(), 0, 1.0)

    episodes, trajectory = run(go())
    assert flaky.resets == [7] and steady.resets == [7]
    assert episodes.restarts == 1 and pool.lost_count == 1
    assert trajectory.reward == 1.0 and trajectory.step_rewards.tolist() == [0.0, 1.0]
    # The flaky server rests; new episodes go to the other one.
    assert pool.pick() is steady


def test_every_start_lost_fails_the_episode_clearly(tokenizer) -> None:
    pool = EnvPool([FlakyBackend(0, "a:1"), FlakyBackend(0, "b:1")], retry_after_seconds=60)

    async def go():
        specs = await pool.specs()
        episodes = runner(
            tokenizer, pool, specs, ScriptedPolicy(tokenizer, ["1"] * 5), episode_attempts=2
        )
        return await episodes.run(guess_task(), 0, 1.0)

    with pytest.raises(EpisodeFailed, match="env-servers lost 2 times"):
        run(go())


def test_env_without_rewards_is_scored_by_the_reward_server(tokenizer) -> None:
    class Unscored(LocalEnvs):
        async def list_envs(self):
            return [EnvSpec("guess_the_number", "", "numbers", gives_reward=False)]

    seen: list[tuple] = []

    async def score(spec, prompt, response, info):
        seen.append((spec.domain, prompt[:12], response))
        return 0.75, {"judge": 0.75}

    pool = EnvPool([Unscored(EnvServerConfig())])
    target = target_of(7)

    async def go():
        specs = await pool.specs()
        policy = ScriptedPolicy(tokenizer, [str(target)])
        return await runner(tokenizer, pool, specs, policy, score).run(guess_task(), 0, 1.0)

    trajectory = run(go())
    assert seen == [("numbers", "I am thinkin", str(target))]
    assert (
        trajectory.reward == pytest.approx(1.75) and trajectory.reward_components["judge"] == 0.75
    )


def test_unknown_env_id_is_named(tokenizer) -> None:
    pool = EnvPool([LocalEnvs(EnvServerConfig())])

    async def go():
        specs = await pool.specs()
        task = EnvTasks(EnvDataset(env_id="no_such_env"))[0]
        return await runner(tokenizer, pool, specs, ScriptedPolicy(tokenizer, [])).run(task, 0, 1.0)

    with pytest.raises(EpisodeFailed, match="'no_such_env' is not offered.*guess_the_number"):
        run(go())


def test_pool_spreads_by_load_and_rests_lost_backends() -> None:
    now = [0.0]
    a, b = LocalEnvs(EnvServerConfig()), LocalEnvs(EnvServerConfig())
    pool = EnvPool([a, b], retry_after_seconds=5, clock=lambda: now[0])
    with pool.lease(pool.pick()) as first:
        second = pool.pick()
        assert second is not first
        with pool.lease(second):
            assert pool.active(a) == pool.active(b) == 1
    pool.report_lost(a, EnvServerLost("gone"))
    pool.report_lost(a, EnvServerLost("gone again"))
    assert pool.lost_count == 1 and pool.healthy() == [b]
    assert all(pool.pick() is b for _ in range(3))
    now[0] = 6.0
    assert pool.healthy() == [a, b]


def test_dns_names_expand_to_every_address() -> None:
    def resolve(host: str, port: int) -> list[str]:
        assert host == "envs.default.svc"
        return [f"10.0.0.1:{port}", f"10.0.0.2:{port}"]

    addresses = ["dns:///envs.default.svc:50051", "10.0.0.9:1"]
    assert expand_addresses(addresses, resolve) == [
        "10.0.0.1:50051",
        "10.0.0.2:50051",
        "10.0.0.9:1",
    ]
    with pytest.raises(ValueError, match="dns:///name:port"):
        expand_addresses(["dns:///noport"], resolve)


def test_demonstrated_episodes_teach_only_the_actions(tokenizer) -> None:
    batch = demo_batches(
        "guess_the_number",
        {"low": 1, "high": 8},
        range(100, 200),
        tokenizer,
        lambda: PlainTurns(tokenizer, "{observation}\n"),
        {"bisect_rate": 1.0},
        max_turns=8,
        max_tokens=400,
    )
    examples = batch(random.Random(0), 4)
    assert len(examples) == 4
    for ids, taught in examples:
        assert len(ids) == len(taught)
        actions = tokenizer.decode([t for t, m in zip(ids, taught, strict=True) if m])
        assert actions and all(part.isdigit() for part in actions.split("<eos>") if part)
        # Bisection finds a number in 1..8 within 4 guesses.
        assert len([part for part in actions.split("<eos>") if part]) <= 4
    with pytest.raises(ValueError, match="no scripted demonstrator for env 'nope'"):
        demonstrator("nope", random.Random(0))


def test_env_call_errors_other_than_bad_actions_fail_the_episode(tokenizer) -> None:
    class Broken(LocalEnvs):
        async def step(self, session_id: str, action: str):
            raise EnvCallError("INTERNAL", "env crashed in step")

    pool = EnvPool([Broken(EnvServerConfig())])

    async def go():
        specs = await pool.specs()
        return await runner(tokenizer, pool, specs, ScriptedPolicy(tokenizer, ["3"])).run(
            guess_task(), 0, 1.0
        )

    with pytest.raises(EpisodeFailed, match="INTERNAL: .*env crashed in step"):
        run(go())


def test_groups_dropped_as_stale_are_launched_again() -> None:
    from rollwire.rollout.orchestrator.pacing import launch_capacity

    # Version 3, bound 1, 8 groups a step: groups for steps 4 and 5 may exist.
    assert launch_capacity(3, 1, 8, 100, dropped_groups=0) == 40
    # Sync mode (bound 0) launches one step's groups at a time.
    assert launch_capacity(3, 0, 8, 100, dropped_groups=0) == 32
    # Never more than the run needs ...
    assert launch_capacity(99, 2, 8, 100, dropped_groups=0) == 808
    # ... except to make up for groups the buffer threw away: a slow episode can
    # outlive the bound, and without a replacement the trainer would wait forever.
    assert launch_capacity(99, 2, 8, 100, dropped_groups=3) == 811
    assert launch_capacity(3, 1, 8, 100, dropped_groups=5) == 45


def test_a_hung_server_is_left_for_another(tokenizer) -> None:
    class Hung(FlakyBackend):
        async def step(self, session_id: str, action: str):
            raise EnvCallError("DEADLINE_EXCEEDED", "no answer within 60s")

    hung, steady = Hung(-1, "hung:1"), FlakyBackend(-1, "steady:1")
    pool = EnvPool([hung, steady], retry_after_seconds=60)
    target = target_of(7)

    async def go():
        specs = await pool.specs()
        policy = ScriptedPolicy(tokenizer, [str(target), str(target)])
        episodes = runner(tokenizer, pool, specs, policy)
        return episodes, await episodes.run(guess_task(), 0, 1.0)

    episodes, trajectory = run(go())
    assert hung.resets == [7] and steady.resets == [7] and episodes.restarts == 1
    assert trajectory.reward == 1.0


def test_a_full_buffer_slows_the_producer_instead_of_losing_the_trajectory() -> None:
    from rollwire.rollout.orchestrator.pacing import put_group_with_backpressure
    from rollwire.services.buffer.protocol import PutAnswer

    class Producer:
        """Refuses the group's second trajectory `full_for` times with `reason`."""

        def __init__(self, full_for: int, reason: str = "full") -> None:
            self.full_for, self.reason, self.sent = full_for, reason, []

        async def put_group(self, trajectories):
            self.sent.append(list(trajectories))
            results = []
            for t in trajectories:
                if t == "second" and self.full_for:
                    self.full_for -= 1
                    results.append(PutAnswer(accepted=False, reason=self.reason))
                else:
                    results.append(PutAnswer(accepted=True, reason="ok"))
            return results

    producer = Producer(full_for=3)
    acks = run(put_group_with_backpressure(producer, ["first", "second"], timeout=30))
    assert [a.accepted for a in acks] == [True, True]
    # Only what was refused is sent again.
    assert producer.sent == [["first", "second"], ["second"], ["second"], ["second"]]
    storage = Producer(full_for=1, reason="storage: No space left on device")
    assert all(a.accepted for a in run(put_group_with_backpressure(storage, ["second"], 30)))
    # Other refusals are answers, not reasons to wait.
    bad = Producer(full_for=5, reason="bad frame")
    assert run(put_group_with_backpressure(bad, ["second"], timeout=30))[0].reason == "bad frame"
    with pytest.raises(TimeoutError, match="did not take a group for 0.2s: full"):
        run(put_group_with_backpressure(Producer(full_for=10**6), ["second"], timeout=0.2))


def test_dynamic_sampling_drops_uniform_groups_up_to_its_budget() -> None:
    from rollwire.rollout.orchestrator.pacing import DynamicSampling

    off = DynamicSampling(enabled=False, per_step=10)
    assert not off.drops([1.0, 1.0], version=0)
    sampling = DynamicSampling(enabled=True, per_step=2)
    assert not sampling.drops([1.0, 0.0, 1.0], version=0)  # signal: kept
    assert sampling.drops([0.0, 0.0], version=0) and sampling.drops([1.0, 1.0], version=0)
    assert not sampling.drops([1.0, 1.0], version=0)  # budget of version 0 spent
    assert sampling.drops([1.0, 1.0], version=1)  # a new version, a new budget


async def test_a_busy_server_is_tried_again_and_each_retry_counted() -> None:
    """`call_server`: UNAVAILABLE and DEADLINE_EXCEEDED are tried again (and counted under
    the call's name); any other status goes straight to the caller."""
    import grpc
    import grpc.aio

    from rollwire.rollout.orchestrator.servers import call_server
    from rollwire.services.core.metrics import COUNTERS
    from rollwire.services.core.retry import RetryPolicy

    def failure(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "busy")

    answers = [
        failure(grpc.StatusCode.UNAVAILABLE),
        failure(grpc.StatusCode.DEADLINE_EXCEEDED),
        "ok",
    ]

    async def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    before = COUNTERS.get("orchestrator_retries", call="probe")
    retries = RetryPolicy(attempts=3, first_pause=0.001, max_pause=0.002)
    assert await call_server(call, retries, "probe") == "ok"
    assert COUNTERS.get("orchestrator_retries", call="probe") == before + 2
    answers[:] = [failure(grpc.StatusCode.INVALID_ARGUMENT), "never"]
    with pytest.raises(grpc.aio.AioRpcError):
        await call_server(call, retries, "probe")
    assert answers == ["never"]
