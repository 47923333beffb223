"""The `judge` and `reward_model` domains: a trained tiny judge on a real rollout-server, a
stub OpenAI-compatible judge, a tiny sequence classifier, and both through the reward-server."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc
from rollwire.reward.judge import Judge, JudgeError, JudgeTokenizer, parse_score, yes_probability
from rollwire.reward.reward_model import RewardModel
from rollwire.reward.scorers import Score, ScoreInput
from rollwire.reward.server import registrations
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import JudgeConfig, RewardModelConfig, RewardServerConfig
from tests.helpers.judges import (
    JUDGE_TEMPLATE,
    chat_reply,
    judge_examples,
    tiny_reward_model,
    train_judge,
)
from tests.helpers.servers import serve_model

torch.set_num_threads(1)
PAIRS = [("2+2", "4"), ("3+5", "8"), ("7+1", "8"), ("6+3", "9")]


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    """The tiny model trained to reply "Score: 9" to a right answer and "Score: 1" to a
    wrong one, for PAIRS."""
    return train_judge(tmp_path_factory.mktemp("judge") / "judge", judge_examples(PAIRS))


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def items_of(pairs, wrong: bool = False) -> list[ScoreInput]:
    return [ScoreInput(response=str(int(a) + wrong), reference=a, prompt=q) for q, a in pairs]


# ---------------------------------------------------------------- pieces


def test_scores_and_probabilities_are_read_as_documented() -> None:
    pattern = JudgeConfig(base_url="http://x").score_pattern
    assert parse_score("Score: 3 ... score = 7.5", pattern, 10) == (0.75, 7.5)
    assert parse_score("SCORE 12", pattern, 10) == (1.0, 12.0)  # clipped to [0, 1]
    with pytest.raises(JudgeError, match="holds no score"):
        parse_score("looks fine to me", pattern, 10)
    assert yes_probability(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert yes_probability(None, -1.0) == 0.0 and yes_probability(-1.0, None) == 1.0
    with pytest.raises(JudgeError, match="neither answer"):
        yes_probability(None, None)


def test_the_judge_tokenizer_renders_the_chat_template_as_transformers_does(
    smollm2_tokenizer,
    tmp_path,
) -> None:
    smollm2_tokenizer.save_pretrained(tmp_path)
    ours = JudgeTokenizer(tmp_path)
    text = "Question: 2+2?\nAnswer: 4\nIs it right? Reply Yes or No."
    expected = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(expected, "keys"):  # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    assert ours.encode(text, chat=True) == list(expected)
    assert ours.encode(text, chat=False) == smollm2_tokenizer(text).input_ids
    assert ours.stop_ids == [smollm2_tokenizer.eos_token_id]
    assert ours.single_token(" Yes", "yes") == smollm2_tokenizer(" Yes").input_ids[-1]
    with pytest.raises(ValueError, match="is 3 tokens"):
        ours.single_token("Yes, definitely", "yes")


# ---------------------------------------------------------------- on a rollout-server


@pytest.mark.integration
async def test_a_trained_judge_on_a_rollout_server_scores_right_and_wrong_answers(
    start_service, judge_path
) -> None:
    address, _ = await serve_model(start_service, judge_path)
    judge = Judge(
        JudgeConfig(
            rollout_server=address,
            tokenizer=judge_path,
            template=JUDGE_TEMPLATE,
            fence_response=False,
        )
    )
    try:
        right = await judge.score(items_of(PAIRS), timeout=30)
        wrong = await judge.score(items_of(PAIRS, wrong=True), timeout=30)
        assert right == [Score(0.9, {"judge_score": 9.0})] * len(PAIRS)
        assert wrong == [Score(0.1, {"judge_score": 1.0})] * len(PAIRS)
        # A reply the pattern does not find is an error for the item, not a zero.
        strict = Judge(
            JudgeConfig(
                rollout_server=address,
                tokenizer=judge_path,
                template=JUDGE_TEMPLATE,
                fence_response=False,
                score_pattern=r"grade=(\d)",
            )
        )
        (verdict,) = await strict.score(items_of(PAIRS[:1]), timeout=30)
        await strict.close()
        assert isinstance(verdict, JudgeError) and "'Score: 9'" in str(verdict)
    finally:
        await judge.close()


@pytest.mark.integration
async def test_a_yes_no_judge_gives_the_models_own_probability(start_service, judge_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    address, _ = await serve_model(start_service, judge_path)
    config = JudgeConfig(
        rollout_server=address,
        tokenizer=judge_path,
        template=JUDGE_TEMPLATE,
        fence_response=False,
        mode="yes_no",
        yes="S",
        no="x",
    )
    judge = Judge(config)
    item = items_of(PAIRS[:1])[0]
    try:
        ((score),) = await judge.score([item], timeout=30)
    finally:
        await judge.close()
    tokenizer = AutoTokenizer.from_pretrained(judge_path)
    model = AutoModelForCausalLM.from_pretrained(judge_path)
    prompt = tokenizer(JUDGE_TEMPLATE.format(**vars(item) | {"max_score": 10})).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    yes, no = (logits[tokenizer.convert_tokens_to_ids(t)].item() for t in ("S", "x"))
    expected = 1 / (1 + math.exp(no - yes))
    assert expected > 0.99  # the trained judge begins every reply with "S"
    assert score.reward == pytest.approx(expected, abs=1e-4)
    assert score.components["p_yes"] == score.reward
    with pytest.raises(ValueError, match=r"judge.yes 'Yes' is 3 tokens"):
        Judge(config.model_copy(update={"yes": "Yes"}))


@pytest.mark.integration
async def test_a_judge_that_does_not_answer_costs_its_items_their_time_limit_only(
    tiny_model_path,
) -> None:
    judge = Judge(JudgeConfig(rollout_server="127.0.0.1:1", tokenizer=tiny_model_path))
    loop = asyncio.get_running_loop()
    started = loop.time()
    verdicts = await judge.score(items_of(PAIRS), timeout=0.5)
    await judge.close()
    assert all(isinstance(v, TimeoutError) for v in verdicts), verdicts
    assert loop.time() - started < 5


# ---------------------------------------------------------------- an OpenAI-compatible judge


async def test_an_openai_compatible_judge_is_asked_and_read_as_configured(openai_judge) -> None:
    base, handler = openai_judge
    handler.replies = {
        "/v1/models": (200, {"data": [{"id": "grader"}]}),
        "/v1/chat/completions": (200, chat_reply("The answer is right.\nScore: 8")),
    }
    judge = Judge(JudgeConfig(base_url=base, api_key="k"))
    (score,) = await judge.score(items_of(PAIRS[:1]), timeout=10)
    assert score == Score(0.8, {"judge_score": 8.0})
    path, body = handler.seen[-1]
    assert path == "/v1/chat/completions" and body["model"] == "grader"
    assert body["temperature"] == 0.0 and body["max_tokens"] == 64
    (message,) = body["messages"]
    assert "Question:\n2+2" in message["content"] and "from 0 to 10" in message["content"]

    # yes/no from the first token's alternatives; case and spacing variants add up.
    handler.replies["/v1/chat/completions"] = (
        200,
        chat_reply("Yes", [("Yes", math.log(0.5)), (" yes", math.log(0.1)), ("No", math.log(0.2))]),
    )
    judge = Judge(JudgeConfig(base_url=base, model="m", mode="yes_no"))
    (score,) = await judge.score(items_of(PAIRS[:1]), timeout=10)
    assert score.reward == pytest.approx(0.75)
    assert handler.seen[-1][1] | {"messages": None} == {
        "model": "m",
        "temperature": 1.0,
        "max_tokens": 1,
        "messages": None,
        "logprobs": True,
        "top_logprobs": 20,
    }

    # Plain completions, and what goes wrong comes back as the item's error.
    handler.replies["/v1/completions"] = (
        200,
        {"choices": [{"text": "N", "logprobs": {"top_logprobs": [{"No": -0.1, "Maybe": -3}]}}]},
    )
    judge = Judge(JudgeConfig(base_url=base, model="m", mode="yes_no", chat=False))
    (score,) = await judge.score(items_of(PAIRS[:1]), timeout=10)
    assert score.reward == 0.0 and handler.seen[-1][1]["logprobs"] == 20
    handler.replies["/v1/completions"] = (500, {"error": "out of memory"})
    (failed,) = await judge.score(items_of(PAIRS[:1]), timeout=10)
    assert isinstance(failed, JudgeError) and "HTTP 500" in str(failed)
    assert "out of memory" in str(failed)


# ---------------------------------------------------------------- a reward model


def test_a_reward_model_scores_batches_as_it_scores_each_item(reward_model_path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    items = [
        ScoreInput(prompt="What is 2+2?", response="<answer>4</answer>"),
        ScoreInput(prompt="Sum 3 and 5.", response="It is 8, because three plus five"),
        ScoreInput(prompt="1+1", response="2"),
    ]
    model = RewardModel(RewardModelConfig(model_path=reward_model_path, batch_size=2))
    batched = asyncio.run(model.score(items, timeout=30))
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_path)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    for item, score in zip(items, batched, strict=True):
        with torch.no_grad():
            ids = tokenizer(item.prompt + item.response, return_tensors="pt")
            logit = reference(**ids).logits[0, 0].item()
        assert score.reward == pytest.approx(logit, abs=1e-5)  # padding changes nothing
        assert score.components == {"logit": score.reward}
    sigmoid = RewardModel(RewardModelConfig(model_path=reward_model_path, output="sigmoid"))
    squashed = sigmoid.score_batch(items)
    assert [s.reward for s in squashed] == pytest.approx(
        [1 / (1 + math.exp(-s.reward)) for s in batched], abs=1e-6
    )
    with pytest.raises(ValueError, match="outside the head's 1 outputs"):
        RewardModel(RewardModelConfig(model_path=reward_model_path, label=1))
    with pytest.raises(ValueError, match="softmax needs a head of two"):
        RewardModel(RewardModelConfig(model_path=reward_model_path, output="softmax"))


# ---------------------------------------------------------------- through the reward-server


@pytest.mark.integration
async def test_the_reward_server_routes_judge_and_reward_model_items_in_one_call(
    start_service, judge_path, reward_model_path
) -> None:
    address, _ = await serve_model(start_service, judge_path)
    config = RewardServerConfig(
        workers=1,
        judge=JudgeConfig(
            rollout_server=address,
            tokenizer=judge_path,
            template=JUDGE_TEMPLATE,
            fence_response=False,
        ),
        reward_model=RewardModelConfig(model_path=reward_model_path),
    )
    (registration,) = registrations(config)
    runtime = await start_service([registration])
    right, wrong = items_of(PAIRS[:1])[0], items_of(PAIRS[:1], wrong=True)[0]
    expected_rm = registration.servicer._batched["reward_model"].score_batch([right])[0]
    try:
        async with open_channel(runtime.address) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            listed = await stub.ListScorers(reward_pb2.ListScorersRequest())
            domains = {s.domain: s.scorer for s in listed.scorers}
            assert domains["judge"] == f"judge (score) on rollout-server {address}"
            assert domains["reward_model"].startswith("reward model ")
            assert listed.parallel_items == 1 and listed.item_timeout_seconds == 10.0

            def item(item_id: str, domain: str, source: ScoreInput) -> reward_pb2.ScoreItem:
                return reward_pb2.ScoreItem(
                    item_id=item_id,
                    domain=domain,
                    prompt=source.prompt,
                    response=source.response,
                    reference=source.reference,
                )

            reply = await stub.Score(
                reward_pb2.ScoreRequest(
                    items=[
                        item("a", "judge", right),
                        item("b", "format", ScoreInput(response="<answer>4</answer>")),
                        item("c", "reward_model", right),
                        item("d", "judge", wrong),
                    ]
                ),
                timeout=60,
            )
    finally:
        await registration.servicer.close()
    results = {r.item_id: r for r in reply.results}
    assert [r.item_id for r in reply.results] == ["a", "b", "c", "d"]  # request order
    assert not any(r.error for r in reply.results), reply
    assert results["a"].reward == pytest.approx(0.9) and results["d"].reward == pytest.approx(0.1)
    assert results["c"].reward == pytest.approx(expected_rm.reward, abs=1e-6)
    assert results["b"].reward == 1.0


# ---------------------------------------------------------------- a run


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_judge_and_a_reward_model_score_a_runs_trajectories(tmp_path, spawn) -> None:
    """`rollwire train` on a mixture of two file datasets, one scored by the trained judge
    (served by its own rollout-server), one by the tiny reward model."""
    from rollwire.services.buffer.durable_log import DurableLog
    from rollwire.services.core.wire import decode_trajectory
    from tests.conftest import rollout_server_args
    from tests.helpers.runs import rollwire

    judge = train_judge(tmp_path / "judge", judge_examples(PAIRS))
    reward_model = tiny_reward_model(tmp_path / "rm")
    rows = "".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in PAIRS)
    (tmp_path / "judged.jsonl").write_text(rows)
    (tmp_path / "ranked.jsonl").write_text(rows)
    ready = tmp_path / "judge.ready"
    server = spawn(rollout_server_args(judge, ready))
    address = server.wait_for_file(ready, timeout=120)
    run = tmp_path / "run"
    parts = ", ".join(
        f"{{dataset: {{type: file, path: {tmp_path / name}, domain: {domain}}}}}"
        for name, domain in (("judged.jsonl", "judge"), ("ranked.jsonl", "reward_model"))
    )
    rollwire(
        tmp_path,
        "train",
        f"run.output_dir={run}",
        "rl.max_steps=2",
        "warmup.steps=0",
        "orchestrator.eval_dataset=null",
        "orchestrator.prompt_template='{question}='",
        f"orchestrator.dataset={{type: mixture, parts: [{parts}]}}",
        f"reward_server.judge={{rollout_server: '{address}', tokenizer: {judge}, "
        f"template: '{JUDGE_TEMPLATE}', fence_response: false, max_new_tokens: 12}}",
        f"reward_server.reward_model={{model_path: {reward_model}}}",
        timeout=500,
    )
    with DurableLog(run / "buffer", sync="never") as log:
        trajectories = [
            decode_trajectory(record[1:]) for _, record in log.replay() if record[:1] == b"T"
        ]
    by_domain = {
        domain: [t for t in trajectories if t.domain == domain]
        for domain in ("judge", "reward_model")
    }
    print({domain: len(group) for domain, group in by_domain.items()})
    assert by_domain["judge"] and by_domain["reward_model"], [t.domain for t in trajectories]
    # A judged trajectory's reward is the judge's score; a reply without one (measured: 1
    # of 304, the judge wrote "9" alone) is an error with reward 0, never a made-up score.
    judged = [t for t in by_domain["judge"] if "judge_score" in t.reward_components]
    print("judge scores:", sorted({t.reward_components["judge_score"] for t in judged}))
    assert len(judged) >= 0.9 * len(by_domain["judge"])
    for t in by_domain["judge"]:
        expected = t.reward_components["judge_score"] / 10 if t in judged else 0.0
        assert t.reward == pytest.approx(expected), t
    for t in by_domain["reward_model"]:
        assert t.reward == pytest.approx(t.reward_components["logit"]), t
    assert len({t.reward for t in by_domain["reward_model"]}) > 1  # a real model, not a constant
