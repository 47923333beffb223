"""The SGLang engine for real, on a CUDA GPU: logprobs against the trainer's recomputation,
seeds and stop tokens, refused requests, aborts, weight updates with tied and untied
embeddings, updates in the middle of a generation, and the rollout-server over gRPC.

SGLang's wheels are CUDA builds, so these are `gpu` tests that also need SGLang
(`pip install 'rollwire[sglang]'`); elsewhere they skip and say why. One test runs
anywhere: without SGLang the module still imports and the engine refuses to start with
an error that says what it needs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.engine import ContextTooLong, RequestError
from rollwire.rollout.server.sampling import SamplingSpec, processed_logprobs
from rollwire.rollout.server.servicer import RolloutServicer
from rollwire.rollout.server.sglang_engine import SGLangEngine
from rollwire.rollout.server.weights import iter_weight_chunks
from rollwire.services.core.client import open_channel
from rollwire.services.core.server import Registration
from tests.helpers.engine_checks import hf_model, load_into, logits_after, perturbed, recomputed

torch.set_num_threads(1)
# float32 on the GPU against a float32 recomputation on the CPU: different kernels (and
# possibly TF32 matmuls) differ by more than on one device, far less than bfloat16 would.
TOLERANCE = 1e-3
# The tiny model's head size and float32 need the Triton attention backend; no CUDA graphs
# (start-up time) and a small share of the GPU's memory.
ENGINE_ARGS = {
    "attention_backend": "triton",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.3,
}
LONG = 3000  # tokens: a generation that takes seconds, so an abort or update lands inside it


def on_gpu(test):
    """A test that needs a CUDA GPU (conftest skips `gpu` tests without one) and SGLang."""
    test = pytest.mark.timeout(900)(pytest.mark.gpu(test))
    return pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed here (its wheels need a CUDA GPU): on a GPU machine "
        "`pip install 'rollwire[sglang]'`",
    )(test)


def tiny(folder, **shape):
    from rollwire.services.core.tiny import TinySpec, ensure_tiny_model

    spec = TinySpec(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **{"max_position_embeddings": 64, **shape},
    )
    return ensure_tiny_model(folder, spec)


@pytest.fixture(scope="module")
def untied_model_path(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("models") / "untied", tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("models") / "long", max_position_embeddings=4096)


def make_engine(path, **options) -> SGLangEngine:
    return SGLangEngine(path, max_batch_size=16, engine_args=ENGINE_ARGS, **options)


def test_without_sglang_the_engine_says_what_it_needs(monkeypatch, tmp_path) -> None:
    """Runs without a GPU: this module imported the engine's module at the top, and
    constructing an engine where SGLang cannot be imported fails with what to do."""
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails as if absent
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="CUDA GPU") as refused:
        SGLangEngine(tmp_path)
    assert "pip install 'rollwire[sglang]'" in str(refused.value)
    with pytest.raises(FileNotFoundError, match="no Hugging Face model"):
        SGLangEngine(tmp_path / "missing")


@on_gpu
class TestOneEngine:
    """Requests on one engine, closed before the tests below start theirs: SGLang's shutdown
    ends every child process of this process, another engine's included."""

    @pytest.fixture(scope="class")
    def engine(self, tiny_model_path):
        engine = make_engine(tiny_model_path)
        yield engine
        asyncio.run(engine.close())

    async def test_logprobs_match_the_trainers_recomputation(self, engine, tiny_model_path) -> None:
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
                recomputed(model, prompt, result.token_ids), abs=TOLERANCE
            )

    async def test_logprobs_are_tempered_and_not_renormalised_by_top_k_or_top_p(
        self, engine, tiny_model_path
    ) -> None:
        """With a temperature alone SGLang's logprobs are the trainer's processed ones; top-k and
        top-p shape the sampling but not the logprob (the module docstring says so)."""
        model = hf_model(tiny_model_path)
        prompt = [5, 6, 7]
        spec = SamplingSpec(temperature=0.7, max_new_tokens=12, seed=3)
        result = await engine.generate("tempered", prompt, spec)
        logits = logits_after(model, prompt, result.token_ids)
        chosen = torch.tensor(result.token_ids)[:, None]
        expected = processed_logprobs(logits, [spec] * 12).gather(1, chosen).squeeze(1)
        assert result.logprobs == pytest.approx(expected.tolist(), abs=TOLERANCE)

        spec = SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, seed=3)
        result = await engine.generate("truncated", prompt, spec)
        logits = logits_after(model, prompt, result.token_ids)
        chosen = torch.tensor(result.token_ids)[:, None]
        tempered = torch.log_softmax(logits / 0.7, dim=-1).gather(1, chosen).squeeze(1)
        assert result.logprobs == pytest.approx(tempered.tolist(), abs=TOLERANCE)
        ranks = (logits > logits.gather(1, chosen)).sum(dim=1)
        assert (ranks < 20).all()  # every token came from the top 20

    async def test_seeds_and_stop_tokens(self, engine) -> None:
        first = await engine.generate("s1", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
        again = await engine.generate("s2", [5, 6], SamplingSpec(max_new_tokens=10, seed=7))
        other = await engine.generate("s3", [5, 6], SamplingSpec(max_new_tokens=10, seed=8))
        assert first.token_ids == again.token_ids != other.token_ids
        unseeded = [
            await engine.generate(f"u{i}", [5, 6], SamplingSpec(max_new_tokens=10))
            for i in range(2)
        ]
        assert unseeded[0].token_ids != unseeded[1].token_ids
        stop = first.token_ids[3]
        stopped = await engine.generate(
            "s4", [5, 6], SamplingSpec(max_new_tokens=10, seed=7, stop_token_ids=frozenset({stop}))
        )
        cut = first.token_ids.index(stop) + 1
        assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[:cut]
        greedy = [
            await engine.generate(f"g{i}", [5, 6], SamplingSpec(max_new_tokens=8, temperature=0))
            for i in range(2)
        ]
        assert greedy[0].token_ids == greedy[1].token_ids

    async def test_bad_requests_are_refused_before_reaching_sglang(self, engine) -> None:
        with pytest.raises(RequestError):
            await engine.generate("x", [], SamplingSpec())
        with pytest.raises(RequestError):
            await engine.generate("x", [engine.vocab_size], SamplingSpec())
        with pytest.raises(ContextTooLong):
            await engine.generate("x", [5] * 10, SamplingSpec(max_new_tokens=60))
        assert (await engine.generate("ok", [5], SamplingSpec(max_new_tokens=2))).token_ids


@on_gpu
async def test_abort_returns_the_tokens_so_far(long_model_path) -> None:
    engine = make_engine(long_model_path)
    try:
        spec = SamplingSpec(max_new_tokens=LONG, seed=2)
        long = asyncio.ensure_future(engine.generate("long", [5], spec))
        await asyncio.sleep(1.0)
        assert engine.running == 1
        assert engine.abort(["long", "unknown"]) == 1
        result = await asyncio.wait_for(long, 30)
        assert result.finish_reason == "abort" and 1 <= len(result.token_ids) < LONG
        assert len(result.logprobs) == len(result.policy_versions) == len(result.token_ids)
        assert engine.running == 0 and engine.waiting == 0
    finally:
        await engine.close()


@on_gpu
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
                recomputed(model, prompt, result.token_ids), abs=TOLERANCE
            )
        with pytest.raises(ValueError, match="not newer"):
            await engine.update_weights(new, 2)
    finally:
        await engine.close()


@on_gpu
@pytest.mark.parametrize("interruptible", [True, False])
async def test_update_mid_generation(interruptible: bool, long_model_path) -> None:
    """Interruptible: the request is aborted, the weights change, and it goes on from its
    tokens so far; per-token versions say which weights made each. Otherwise it waits."""
    engine = make_engine(long_model_path, interruptible=interruptible)
    try:
        model = hf_model(long_model_path)
        old = {name: p.detach().clone() for name, p in model.named_parameters()}
        prompt = [5, 6, 7]
        running = asyncio.ensure_future(
            engine.generate("mid", prompt, SamplingSpec(max_new_tokens=LONG, seed=1))
        )
        await asyncio.sleep(1.0)
        assert engine.running == 1
        new = perturbed(model, seed=11)
        await engine.update_weights(new, 1)
        if not interruptible:  # the update waited for the request to finish
            assert running.done()
            result = running.result()
            assert result.policy_versions == [0] * LONG and result.policy_version == 0
            assert engine.interrupted_requests == 0 and engine.version == 1
            return
        result = await asyncio.wait_for(running, 120)
        assert len(result.token_ids) == LONG and result.policy_version == 1
        cut = result.policy_versions.index(1)
        assert 1 <= cut < LONG and result.policy_versions == [0] * cut + [1] * (LONG - cut)
        assert engine.interrupted_requests == 1 and engine.interrupted_updates == 1
        before = recomputed(model, prompt, result.token_ids)[:cut]
        load_into(model, new)
        after = recomputed(model, prompt, result.token_ids)[cut:]
        assert result.logprobs[:cut] == pytest.approx(before, abs=TOLERANCE)
        assert result.logprobs[cut:] == pytest.approx(after, abs=TOLERANCE)
        load_into(model, old)
    finally:
        await engine.close()


@on_gpu
async def test_rollout_server_over_grpc_with_sglang(start_service, tiny_model_path) -> None:
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
        assert status.engine == "sglang" and status.policy_version == 0
        report = await measure(runtime.address, requests=8, max_new_tokens=12)
        assert report.engine == "sglang" and report.tokens == 8 * 12
        assert report.abs_max < TOLERANCE and report.kl < 1e-6, report.table()
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
                recomputed(model, [5, 6], list(sample.token_ids)), abs=TOLERANCE
            )
    await servicer.close()
