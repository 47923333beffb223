"""Sampling by hand, the HF engine's batching, logprobs, aborts and weight swaps,
and the rollout-server over gRPC."""

from __future__ import annotations

import asyncio
import math
import os
import re
import time

import grpc
import grpc.aio
import pytest
import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.hf_engine import ContextTooLong, HFEngine, RequestError
from rollwire.rollout.server.sampling import SamplingSpec, processed_logprobs
from rollwire.rollout.server.weights import WeightAssembler, WeightStreamError, iter_weight_chunks
from rollwire.services.core.client import open_channel
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.tokenizer import tokenizer_digest
from tests.helpers.servers import serve_engine

torch.set_num_threads(1)
DEVICE = os.environ.get("ROLLWIRE_TEST_DEVICE", "cpu")
"""Where the HF engine tests put the engine: deploy/gpu/checks.sh runs them with `cuda`."""
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (SamplingSpec(), [0.5, 0.3, 0.15, 0.05]),
        (SamplingSpec(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        # mass before the third token is exactly 0.8: it is dropped at top_p 0.8, kept at 0.81
        (SamplingSpec(top_p=0.8), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        (SamplingSpec(top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        # temperature 0.5 squares the probabilities before renormalising
        (SamplingSpec(temperature=0.5), [p * p / 0.365 for p in (0.5, 0.3, 0.15, 0.05)]),
        (SamplingSpec(top_k=3, top_p=0.5), [1, 0, 0, 0]),
    ],
)
def test_processed_distribution_by_hand(spec: SamplingSpec, expected: list[float]) -> None:
    assert processed_logprobs(PROBS.log(), [spec]).exp()[0].tolist() == pytest.approx(
        expected, abs=1e-6
    )


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0].float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


@pytest.fixture
async def engine(tiny_model_path):
    engine = HFEngine(tiny_model_path, max_batch_size=8, batch_wait_seconds=0.05, device=DEVICE)
    await engine.start()
    yield engine
    await engine.close()


async def test_batched_generation_matches_an_unbatched_forward(engine) -> None:
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    spec = SamplingSpec(max_new_tokens=12, seed=0)
    results = await asyncio.gather(
        *(engine.generate(f"r{i}", p, spec) for i, p in enumerate(prompts))
    )
    assert engine.generated_tokens == 4 * 12
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == 12 and result.finish_reason == "length"
        # Left padding and the KV cache must not change what each row sees.
        assert result.logprobs == pytest.approx(
            reference_logprobs(engine.model, prompt, result.token_ids), abs=1e-4
        )
        assert result.policy_versions == [0] * 12


async def test_the_engine_seed_repeats_requests_that_bring_none(tiny_model_path) -> None:
    """rollout_server.seed starts the generator of requests without a seed: two engines
    with one seed sample the same tokens, another seed other ones."""
    drawn = []
    for seed in (11, 11, 12):
        engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE, seed=seed)
        await engine.start()
        try:
            spec = SamplingSpec(max_new_tokens=24, temperature=1.5)
            drawn.append([(await engine.generate(f"r{i}", [5, 6], spec)).token_ids for i in (0, 1)])
        finally:
            await engine.close()
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]


async def test_seeds_stop_tokens_and_temperature(engine) -> None:
    first = await engine.generate("a", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
    again = await engine.generate("b", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
    assert first.token_ids == again.token_ids
    stop = first.token_ids[3]
    stopped = await engine.generate(
        "c", [5, 6], SamplingSpec(max_new_tokens=10, seed=7, stop_token_ids=frozenset({stop}))
    )
    cut = first.token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[:cut]
    greedy = await engine.generate("d", [5, 6], SamplingSpec(max_new_tokens=6, temperature=0))
    hot = await engine.generate(
        "e", [5, 6], SamplingSpec(max_new_tokens=6, temperature=2.0, seed=1)
    )
    # Greedy tokens are argmax picks; a temperature-2 logprob is taken at temperature 2.
    assert (
        greedy.token_ids
        == (
            await engine.generate("f", [5, 6], SamplingSpec(max_new_tokens=6, temperature=0))
        ).token_ids
    )
    with torch.no_grad():
        logits = engine.model(torch.tensor([[5, 6, *hot.token_ids]], device=DEVICE)).logits[0, 1:-1]
    logits = logits.float().cpu()
    expected = (
        torch.log_softmax(logits / 2.0, -1)
        .gather(1, torch.tensor(hot.token_ids)[:, None])
        .squeeze(1)
    )
    assert hot.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


async def test_concurrent_requests_share_batches(engine) -> None:
    spec = SamplingSpec(max_new_tokens=4)
    sizes = []
    original = engine._generate_batch

    def recording(batch):
        sizes.append(len(batch))
        return original(batch)

    engine._generate_batch = recording
    await asyncio.gather(*(engine.generate(f"r{i}", [5 + i], spec) for i in range(16)))
    assert sum(sizes) == 16
    assert len(sizes) <= 4, f"16 concurrent requests ran in batches of {sizes}"
    assert max(sizes) == 8


async def test_bad_requests(engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        await engine.generate("x", [], SamplingSpec())
    with pytest.raises(RequestError, match=r"must lie in \[0, "):
        await engine.generate("x", [engine.vocab_size], SamplingSpec())
    with pytest.raises(ContextTooLong, match="exceeds the model's context of 64"):
        await engine.generate("x", [5] * 10, SamplingSpec(max_new_tokens=60))
    with pytest.raises(RequestError, match="temperature"):
        await engine.generate("x", [5], SamplingSpec(temperature=-1))


async def test_abort_returns_tokens_so_far(engine) -> None:
    # Slowed and waited for: on a fast machine 60 tiny-model tokens end in under 0.1 s.
    slow_down(engine, 0.01)
    slow = asyncio.ensure_future(engine.generate("long", [5], SamplingSpec(max_new_tokens=60)))
    await until_running(engine)
    await asyncio.sleep(0.05)
    assert engine.abort(["long", "unknown"]) == 1
    result = await slow
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 60
    assert len(result.logprobs) == len(result.token_ids)


def perturbed(engine: HFEngine, scale: float = 0.5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=generator).to(p.device)
        for name, p in engine.model.named_parameters()
    }


async def test_weight_update_is_versioned_and_changes_the_model(engine) -> None:
    new = perturbed(engine)
    before = await engine.generate("a", [5, 6], SamplingSpec(max_new_tokens=8, seed=1))
    await engine.update_weights(new, version=1)
    after = await engine.generate("b", [5, 6], SamplingSpec(max_new_tokens=8, seed=1))
    assert engine.version == 1 and after.policy_versions == [1] * 8
    assert after.logprobs == pytest.approx(
        reference_logprobs(engine.model, [5, 6], after.token_ids), abs=1e-4
    )
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)
    with pytest.raises(ValueError, match="not newer"):
        await engine.update_weights(new, version=1)


def slow_down(engine: HFEngine, seconds: float = 0.002) -> None:
    """Makes every forward pass of `engine` take at least `seconds` longer."""
    forward = engine.model.forward

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    engine.model.forward = slowed


async def until_running(engine: HFEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not engine.running:
        assert time.monotonic() < deadline, "the engine never started a batch"
        await asyncio.sleep(0.005)


async def test_a_request_whose_caller_went_away_stops_generating(tiny_model_path) -> None:
    """A deadline past or a hung-up client cancels the handler; its row must not run on."""
    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    await engine.start()
    try:
        slow_down(engine, 0.02)
        gone = asyncio.ensure_future(engine.generate("gone", [5], SamplingSpec(max_new_tokens=60)))
        await until_running(engine)
        gone.cancel()
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.running == 0, "the cancelled request kept its row"
        assert engine.generated_tokens < 60
        result = await engine.generate("next", [5], SamplingSpec(max_new_tokens=3))
        assert len(result.token_ids) == 3
    finally:
        await engine.close()


async def test_an_update_mid_generation_keeps_the_tokens_and_tags_each_with_its_version(
    tiny_model_path,
) -> None:
    import copy

    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    await engine.start()
    try:
        old_model = copy.deepcopy(engine.model)
        new = perturbed(engine)
        slow_down(engine)  # so what happens mid-batch does, on any machine
        long = SamplingSpec(max_new_tokens=engine.max_context - 4, seed=5)
        prompts = [[5, 6, 7], [9]]
        running = [
            asyncio.ensure_future(engine.generate(f"long{i}", p, long))
            for i, p in enumerate(prompts)
        ]
        await until_running(engine)
        await asyncio.sleep(0.05)  # some tokens in
        await asyncio.wait_for(engine.update_weights(new, version=1), 10)
        assert not all(task.done() for task in running), "the update waited for the batch"
        results = await asyncio.wait_for(asyncio.gather(*running), 60)
    finally:
        await engine.close()
    assert engine.interrupted_batches == 1
    for prompt, result in zip(prompts, results, strict=True):
        versions = result.policy_versions
        switch = versions.index(1)
        assert 0 < switch < len(versions) and versions == [0] * switch + [1] * (
            len(versions) - switch
        )
        # Each token's logprob is that of the weights that chose it.
        old = reference_logprobs(old_model, prompt, result.token_ids)
        now = reference_logprobs(engine.model, prompt, result.token_ids)
        assert result.logprobs[:switch] == pytest.approx(old[:switch], abs=1e-4)
        assert result.logprobs[switch:] == pytest.approx(now[switch:], abs=1e-4)


async def a_long_request_running(engine: HFEngine, max_new_tokens: int) -> asyncio.Future:
    """A request for [5, 6, 7] generating on a slowed-down engine, a few steps in."""
    slow_down(engine)
    long = asyncio.ensure_future(
        engine.generate("long", [5, 6, 7], SamplingSpec(max_new_tokens=max_new_tokens, seed=1))
    )
    await until_running(engine)
    await asyncio.sleep(0.03)
    return long


async def test_a_request_joins_a_running_batch_and_is_answered_when_its_row_ends(
    tiny_model_path,
) -> None:
    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    await engine.start()
    try:
        long = await a_long_request_running(engine, 50)
        short = await asyncio.wait_for(
            engine.generate("short", [9, 10], SamplingSpec(max_new_tokens=5, seed=2)), 10
        )
        assert not long.done(), "the short request waited for the long one"
        assert engine.joined_rows == 1
        first = await asyncio.wait_for(long, 30)
        alone = await engine.generate("again", [9, 10], SamplingSpec(max_new_tokens=5, seed=2))
    finally:
        await engine.close()
    # Joining mid-batch changes nothing about what either request gets.
    assert short.token_ids == alone.token_ids
    assert short.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert len(first.token_ids) == 50
    assert first.logprobs == pytest.approx(
        reference_logprobs(engine.model, [5, 6, 7], first.token_ids), abs=1e-4
    )


async def test_rows_join_and_leave_a_running_batch_on_its_kv_cache(tiny_model_path) -> None:
    """Newcomers' prompts are computed alone and put beside the running cache (one as
    short as one token, one longer than the cache is wide); finished rows leave it. No
    request sees anything but its own tokens: every logprob is that of a lone forward."""
    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    await engine.start()
    try:
        first = await a_long_request_running(engine, 40)
        prompts = {"one": [9], "wide": list(range(4, 34)), "mid": [12, 13, 14, 15]}
        specs = {
            "one": SamplingSpec(max_new_tokens=6, seed=2),
            "wide": SamplingSpec(max_new_tokens=20, seed=3),
            "mid": SamplingSpec(max_new_tokens=8, temperature=0.0),
        }
        joined = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(key, prompts[key], specs[key]) for key in prompts)),
            30,
        )
        result = await asyncio.wait_for(first, 30)
    finally:
        await engine.close()
    assert engine.joined_rows == 3
    assert engine.layouts == 1, "a join laid the batch out again instead of keeping its cache"
    assert engine.cache_merges >= 2  # the joins, and the finished rows dropped
    for key, generation in zip(prompts, joined, strict=True):
        assert len(generation.token_ids) == specs[key].max_new_tokens
        assert generation.logprobs == pytest.approx(
            reference_logprobs(engine.model, prompts[key], generation.token_ids), abs=1e-4
        ), key
    assert len(result.token_ids) == 40
    assert result.logprobs == pytest.approx(
        reference_logprobs(engine.model, [5, 6, 7], result.token_ids), abs=1e-4
    )


async def test_an_engine_that_is_not_interruptible_updates_between_batches(
    tiny_model_path,
) -> None:
    engine = HFEngine(tiny_model_path, max_batch_size=8, interruptible=False, device=DEVICE)
    await engine.start()
    try:
        slow_down(engine)
        task = asyncio.ensure_future(
            engine.generate("long", [5, 6], SamplingSpec(max_new_tokens=50, seed=5))
        )
        await until_running(engine)
        await engine.update_weights(perturbed(engine), version=1)
        await asyncio.sleep(0)  # the batch's results were set before the update ran
        assert task.done() and task.result().policy_versions == [0] * 50
    finally:
        await engine.close()


def test_weight_stream_round_trip_and_rejections() -> None:
    params = {"w": ((2, 3), torch.float32), "b": ((3,), torch.bfloat16)}
    tensors = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
    }
    chunks = list(iter_weight_chunks(tensors.items(), version=4, chunk_bytes=8))
    assert [c.name for c in chunks] == [
        "w",
        "w",
        "w",
        "b",
    ]  # 24 bytes in 8-byte chunks, then 6 bytes
    assembler = WeightAssembler(params, served_version=3)
    for chunk in chunks:
        assembler.add(chunk)
    got, version = assembler.finish()
    assert (
        version == 4 and torch.equal(got["w"], tensors["w"]) and torch.equal(got["b"], tensors["b"])
    )

    def rejects(chunk_list, message, served=3, code="INVALID_ARGUMENT"):
        assembler = WeightAssembler(params, served_version=served)
        with pytest.raises(WeightStreamError, match=message) as caught:
            for chunk in chunk_list:
                assembler.add(chunk)
            assembler.finish()
        assert caught.value.code == code

    rejects(chunks, "not newer than the served version 4", served=4, code="FAILED_PRECONDITION")
    rejects(chunks[:2], r"ended before all their bytes arrived: \['w'\]")
    rejects([chunks[0], chunks[2]], "does not follow the 8 bytes received")
    rejects(
        list(iter_weight_chunks([("w", torch.zeros(3, 2))], 4)),
        r"shape \(3, 2\) where the model has \(2, 3\)",
    )
    rejects(list(iter_weight_chunks([("v", torch.zeros(2, 3))], 4)), "unknown parameter 'v'")
    rejects([], "carried no chunks")
    mixed = list(iter_weight_chunks([("w", tensors["w"])], 4)) + list(
        iter_weight_chunks([("b", tensors["b"])], 5)
    )
    rejects(mixed, "has version 5, the stream began with 4")


@pytest.fixture
async def rollout_stub(start_service, tiny_model_path):
    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    address, servicer = await serve_engine(start_service, engine)
    async with open_channel(address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel), engine
    await servicer.close()


def generate_request(request_id: str, **sampling) -> rollout_pb2.GenerateRequest:
    params = {"temperature": 1.0, "max_new_tokens": 6, **sampling}
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7],
        sampling=rollout_pb2.SamplingParams(**params),
    )


@pytest.mark.integration
async def test_rollout_server_generate_update_status(rollout_stub) -> None:
    stub, engine = rollout_stub
    reply = await stub.Generate(generate_request("one", seed=3))
    assert len(reply.token_ids) == len(reply.logprobs) == len(reply.policy_versions) == 6
    assert reply.finish_reason == rollout_pb2.FINISH_REASON_LENGTH and reply.policy_version == 0
    assert all(math.isfinite(x) and x <= 0 for x in reply.logprobs)

    new = perturbed(engine)
    update = await stub.UpdateWeights(iter_weight_chunks(new.items(), version=1, chunk_bytes=1000))
    assert update.version == 1 and update.tensors == len(new)
    assert update.bytes_received == sum(t.numel() * 4 for t in new.values())
    assert all(torch.equal(p, new[n]) for n, p in engine.model.named_parameters())
    status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
    assert status.policy_version == 1 and status.engine == "hf" and status.generated_tokens == 6
    assert list((await stub.Generate(generate_request("two"))).policy_versions) == [1] * 6


@pytest.mark.integration
async def test_rollout_server_rejects_bad_input_and_keeps_serving(rollout_stub) -> None:
    stub, engine = rollout_stub
    before = {n: p.clone() for n, p in engine.model.named_parameters()}

    async def expect(call, code, text):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() is code and text in caught.value.details()

    await expect(
        stub.Generate(rollout_pb2.GenerateRequest(request_id="e")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "empty",
    )
    for bad in ({"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}):
        await expect(
            stub.Generate(generate_request("nan", **bad)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "must be finite",
        )
    await expect(
        stub.Generate(generate_request("long", max_new_tokens=100)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "context of 64",
    )
    good = list(iter_weight_chunks(perturbed(engine).items(), version=2))
    broken = [
        *good[:-1],
        rollout_pb2.WeightChunk(
            version=2, name="nope", dtype="<f4", shape=[1], total_bytes=4, data=b"\0" * 4
        ),
    ]
    await expect(
        stub.UpdateWeights(iter(broken)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown parameter 'nope'",
    )
    # A rejected stream changed nothing, not even the tensors that arrived before the bad chunk.
    assert engine.version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    await stub.UpdateWeights(iter(good))
    await expect(
        stub.UpdateWeights(iter(good)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "not newer than the served version 2",
    )
    assert len((await stub.Generate(generate_request("fine"))).token_ids) == 6


async def test_score_gives_the_models_logprobs_of_given_tokens(engine) -> None:
    """Scoring is one forward: each token's logprob after the ones before it, at
    temperature 1, for sequences of different lengths in one padded batch."""
    sequences = [([5, 6, 7, 8, 9], 2), ([10, 11, 12], 1), ([13, 14, 15, 16, 17, 18, 19], 6)]
    scores, version = await engine.score(sequences, top_k=3)
    assert version == 0
    for (ids, start), got in zip(sequences, scores, strict=True):
        assert got.logprobs == pytest.approx(
            reference_logprobs(engine.model, ids[:start], ids[start:]), abs=1e-5
        )
        with torch.no_grad():
            logits = (
                engine.model(torch.tensor([ids], device=DEVICE)).logits[0, start - 1 : -1].cpu()
            )
        best = torch.log_softmax(logits.float(), dim=-1).topk(3, dim=-1)
        assert got.top_token_ids == best.indices.tolist()
        assert torch.allclose(torch.tensor(got.top_logprobs), best.values, atol=1e-5)
    # Without top_k only the tokens' own logprobs come back.
    (plain,), _ = await engine.score([([5, 6, 7], 1)], top_k=0)
    assert len(plain.logprobs) == 2 and plain.top_token_ids == [] == plain.top_logprobs


async def test_score_rejects_what_it_cannot_score(engine) -> None:
    for sequences, top_k, text in (
        ([], 0, "no sequences"),
        ([([5, 6], 0)], 0, "start 0 outside [1, 2)"),
        ([([5, 6], 2)], 0, "start 2 outside"),
        ([([5, -1, 6], 1)], 0, "token ids must lie in"),
        ([([5, 6], 1)], 65, "top_k must lie in [0, 64]"),
    ):
        with pytest.raises(RequestError, match=re.escape(text)):
            await engine.score(sequences, top_k)
    with pytest.raises(ContextTooLong):
        await engine.score([(list(range(1, 70)), 1)], 0)


@pytest.mark.integration
async def test_rollout_server_scores_tokens_and_refuses_bad_requests(rollout_stub) -> None:
    stub, engine = rollout_stub
    request = rollout_pb2.ScoreTokensRequest(
        request_id="s",
        sequences=[rollout_pb2.TokenSequence(token_ids=[5, 6, 7, 8], start=2)],
        top_k=2,
    )
    reply = await stub.ScoreTokens(request)
    (scores,) = reply.sequences
    assert list(scores.logprobs) == pytest.approx(
        reference_logprobs(engine.model, [5, 6], [7, 8]), abs=1e-5
    )
    assert len(scores.top_token_ids) == len(scores.top_logprobs) == 2 * 2
    before = COUNTERS.get("rollout_rejected", reason="bad_request")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ScoreTokens(
            rollout_pb2.ScoreTokensRequest(
                sequences=[rollout_pb2.TokenSequence(token_ids=[5, 6], start=5)]
            )
        )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "start 5 outside [1, 2)" in caught.value.details()
    assert COUNTERS.get("rollout_rejected", reason="bad_request") == before + 1
    # Still serving; and its status names its tokenizer, as another server of it would.
    assert len((await stub.ScoreTokens(request)).sequences) == 1
    status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
    assert len(status.tokenizer_digest) == 64
    assert status.tokenizer_digest == tokenizer_digest(engine.model_path)


@pytest.mark.multiproc
def test_rollout_server_process(spawn, tmp_path, tiny_model_path) -> None:
    import subprocess
    import sys

    from tests.conftest import rollout_server_args

    ready = tmp_path / "ready"
    cli = [sys.executable, "-m", "rollwire.services.app.cli"]
    child = spawn(rollout_server_args(tiny_model_path, ready))
    address = child.wait_for_file(ready, timeout=60)
    health = subprocess.run(
        [*cli, "health", address, "--service", "rollwire.v1.RolloutService"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert health.stdout.strip() == "SERVING", health.stderr
    code, _, err = child.terminate()
    assert code == 0, err

    missing = subprocess.run(
        [
            *cli,
            "rollout-server",
            "--port",
            "0",
            "--set",
            f"rollout_server.model_path={tmp_path / 'nowhere'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1
    assert (
        "no Hugging Face model at" in missing.stderr
        and "rollout_server.model_path" in missing.stderr
    )


@pytest.mark.integration
async def test_generate_group_samples_a_prompt_n_times(rollout_stub) -> None:
    stub, engine = rollout_stub
    params = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=5)
    reply = await stub.GenerateGroup(
        rollout_pb2.GenerateGroupRequest(
            request_id="g", prompt_token_ids=[5, 6], sampling=params, num_samples=6
        )
    )
    assert [s.request_id for s in reply.samples] == [f"g/{i}" for i in range(6)]
    assert all(len(s.token_ids) == len(s.logprobs) == 5 for s in reply.samples)
    assert len({tuple(s.token_ids) for s in reply.samples}) > 1  # independent samples, not copies
    for sample in reply.samples:
        assert list(sample.logprobs) == pytest.approx(
            reference_logprobs(engine.model, [5, 6], list(sample.token_ids)), abs=1e-4
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GenerateGroup(
            rollout_pb2.GenerateGroupRequest(request_id="z", prompt_token_ids=[5], sampling=params)
        )
    assert (
        caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        and "num_samples" in caught.value.details()
    )


async def test_mismatch_tool_finds_the_hf_engine_agrees_with_the_trainer(
    start_service, tiny_model_path
) -> None:
    from rollwire.trainer.rl.mismatch import measure

    engine = HFEngine(tiny_model_path, max_batch_size=8, device=DEVICE)
    address, servicer = await serve_engine(start_service, engine)
    try:
        report = await measure(address, requests=8, max_new_tokens=12)
        assert report.engine == "hf" and report.tokens == 8 * 12
        assert report.abs_max < 1e-4 and report.kl < 1e-8, report.table()
        # Different weights are seen for what they are.
        await engine.update_weights(perturbed(engine), version=1)
        moved = await measure(address, tiny_model_path, requests=8, max_new_tokens=12)
        assert moved.policy_version == 1 and moved.abs_mean > 0.1 and moved.kl > 1e-3
        assert "KL(engine || trainer)" in moved.table()
    finally:
        await servicer.close()


@pytest.mark.integration
async def test_the_threads_of_the_hf_engine_change_from_its_next_batch_on(rollout_stub) -> None:
    stub, engine = rollout_stub

    def on_worker() -> int:
        return engine._worker.submit(torch.get_num_threads).result(timeout=10)

    before = on_worker()
    assert (await stub.GetStatus(rollout_pb2.RolloutStatusRequest())).threads == before
    reply = await stub.SetThreads(rollout_pb2.SetThreadsRequest(threads=before + 1))
    assert reply.applied and reply.threads == before + 1 and not reply.reason
    assert on_worker() == before + 1  # on the thread that computes, not on this one
    assert len((await stub.Generate(generate_request("after"))).token_ids) == 6
    assert (await stub.GetStatus(rollout_pb2.RolloutStatusRequest())).threads == before + 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.SetThreads(rollout_pb2.SetThreadsRequest(threads=0))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await stub.SetThreads(rollout_pb2.SetThreadsRequest(threads=before))
    assert on_worker() == before
