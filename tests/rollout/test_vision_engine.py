"""The HF engine with a vision-language model: images in its batches (new, joined and
laid out again after new weights) and in ScoreTokens give the logprobs the trainer's
forward gives, and a bad image is refused to its caller while the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
import torch

from rollwire.proto.v1 import env_pb2, rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.hf_engine import HFEngine, RequestError
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.services.core.client import open_channel
from rollwire.services.core.images import ImageRef
from rollwire.services.core.metrics import COUNTERS
from rollwire.trainer.batching import collate
from rollwire.trainer.models.vision_lm import VisionLM
from tests.helpers.servers import serve_engine
from tests.helpers.vision import digit_prompts, generated_sequence, trainer_gap


async def test_generation_with_images_agrees_with_the_trainer(tiny_vlm_path) -> None:
    prompts = digit_prompts(tiny_vlm_path, 6)
    engine = HFEngine(tiny_vlm_path, max_batch_size=8, batch_max_wait_seconds=0.05)
    await engine.start()
    try:
        specs = [SamplingSpec(temperature=1.0, max_new_tokens=10 + i, seed=i) for i in range(6)]

        def start(i: int) -> asyncio.Task:
            ids, images = prompts[i]
            return asyncio.create_task(engine.generate(f"r{i}", ids, specs[i], images))

        tasks = [start(i) for i in range(3)]
        while engine.running == 0:  # the first batch is decoding: the others join it
            await asyncio.sleep(0.005)
        tasks += [start(i) for i in range(3, 6)]
        outputs = await asyncio.gather(*tasks)
        assert engine.joined_rows >= 1, "no request joined a running batch"
        # A teacher's ScoreTokens of the same sequences with their images (on-policy
        # distillation between two vision models) gives the same logprobs.
        sequences = [
            (ids + list(out.token_ids), len(ids))
            for (ids, _), out in zip(prompts, outputs, strict=True)
        ]
        scores, _ = await engine.score(sequences, 2, [images for _, images in prompts])
        for out, scored in zip(outputs, scores, strict=True):
            assert (
                max(abs(a - b) for a, b in zip(out.logprobs, scored.logprobs, strict=True)) <= 1e-5
            )
        ids = prompts[1][0]
        with pytest.raises(RequestError, match="image pad tokens but no image"):
            await engine.score([([*ids, 5], len(ids))], 0)
    finally:
        await engine.close()
    gap, compared = trainer_gap(tiny_vlm_path, prompts, outputs)
    assert compared > 60 and gap <= 1e-5, gap


async def test_a_weight_update_mid_batch_lays_image_rows_out_again(tiny_vlm_path) -> None:
    """New weights arrive while image rows decode: their prompts (pixels included) are
    computed again under them, and every token's logprob is that of the version that chose it."""
    ((ids, images),) = digit_prompts(tiny_vlm_path, 2)[1:]
    engine = HFEngine(tiny_vlm_path, max_batch_size=4)
    await engine.start()
    try:
        spec = SamplingSpec(temperature=1.0, max_new_tokens=40, stop_token_ids=frozenset(), seed=1)
        task = asyncio.create_task(engine.generate("r", ids, spec, images))
        while engine.running == 0:
            await asyncio.sleep(0.002)
        new = {n: p + 0.05 * torch.randn_like(p) for n, p in engine.model.named_parameters()}
        await engine.update_weights(new, version=1)
        out = await task
    finally:
        await engine.close()
    assert set(out.policy_versions) == {0, 1} and engine.interrupted_batches == 1
    family = VisionLM()
    model = family.load(tiny_vlm_path).eval()
    model.load_state_dict(new, strict=False)
    batch = collate([generated_sequence(ids, images, out)], 0)
    with torch.no_grad():
        logits = family.logits(model, batch, torch.device("cpu"))
    ours = torch.log_softmax(logits.float(), -1).gather(-1, batch.targets[..., None])[..., 0]
    late = batch.mask * (batch.policy_versions == 1)
    assert late.sum() > 0
    assert float(((ours - batch.behaviour_logprobs).abs() * late).max()) <= 1e-5


@pytest.mark.integration
async def test_bad_images_are_refused_and_the_server_keeps_serving(
    start_service, tiny_vlm_path, tiny_model_path, tmp_path
) -> None:
    ((ids, images),) = digit_prompts(tiny_vlm_path, 2)[1:]
    engine = HFEngine(tiny_vlm_path, max_batch_size=4)
    address, servicer = await serve_engine(start_service, engine)
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=4)

    def request(*images: rollout_pb2.Image, prompt=ids) -> rollout_pb2.GenerateRequest:
        return rollout_pb2.GenerateRequest(
            request_id="x", prompt_token_ids=prompt, sampling=sampling, images=images
        )

    good = env_pb2.Image(data=images[0].data, format="png")
    path = tmp_path / "digit.png"
    path.write_bytes(images[0].data)
    before = COUNTERS.get("rollout_rejected", reason="bad_request")
    async with open_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for bad, message in (
            (request(env_pb2.Image(data=b"GIF89a broken", format="gif")), "not an image"),
            (request(env_pb2.Image(uri=str(tmp_path / "gone.png"))), "No such file"),
            (request(env_pb2.Image(data=images[0].data, format="jpeg")), "says it is jpeg"),
            (request(), "image pad tokens but no image"),
            (request(good, good), "make 8"),
            (request(env_pb2.Image()), "either by value"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(bad)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
            assert message in caught.value.details(), caught.value.details()
        assert COUNTERS.get("rollout_rejected", reason="bad_request") >= before + 4
        by_reference = await stub.Generate(request(env_pb2.Image(uri=str(path))))
        assert len(by_reference.token_ids) == 4
    await servicer.close()
    text_engine = HFEngine(tiny_model_path)
    with pytest.raises(RequestError, match="takes no images"):
        await text_engine.generate(
            "x", [5, 6], SamplingSpec(max_new_tokens=4), [ImageRef(data=b"x", format="png")]
        )
