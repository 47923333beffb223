"""The diffusion engine (rollout/server/diffusion_engine.py): seeded samples batched
across calls, log-probabilities the trainer recomputes, weights taken between denoising
steps, aborts, and bad requests refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollwire.diffusion.digits import DigitsSpec, build_digits_model
from rollwire.diffusion.sampling import SamplingSettings, step_logprobs
from rollwire.rollout.server.diffusion_engine import DiffusionEngine, ImageRequest
from rollwire.rollout.server.engine import RequestError
from rollwire.trainer.models.flow_denoiser import FlowDenoiser, Noised

SDE = SamplingSettings(steps=6, eta=0.8, sde_window=(1, 5))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits") / "model"
    return build_digits_model(folder, DigitsSpec(steps=2, batch_size=8), progress=False)


def requests(prefix: str, prompts: list[str], seeds: list[int]) -> list[ImageRequest]:
    return [
        ImageRequest(f"{prefix}-{i}", p, s)
        for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
    ]


async def test_samples_are_seeded_and_their_logprobs_are_the_trainers(model_path) -> None:
    engine = DiffusionEngine(model_path)
    await engine.start()
    try:
        alone = (await engine.generate_images(requests("a", ["3"], [7]), SDE))[0]
        # Two calls at once share one batch; each sample is still its seed's (up to the
        # float rounding a batch of another size gives the convolutions).
        both = await asyncio.gather(
            engine.generate_images(requests("b", ["any", "3"], [1, 7]), SDE),
            engine.generate_images(requests("c", ["9"], [2]), SDE),
        )
        again = both[0][1]
        torch.testing.assert_close(
            torch.from_numpy(again.image), torch.from_numpy(alone.image), atol=1e-5, rtol=0
        )
        assert again.recorded_steps == [1, 2, 3, 4] and again.latents.shape == (5, 1, 8, 8)
        assert again.label == 3 and both[0][0].label == 10 and again.finish_reason == "stop"
        assert again.policy_versions == [0, 0, 0, 0]
        # The trainer's recomputation from the recorded latents, with its own copy.
        trainer = FlowDenoiser().load(model_path).eval()

        def velocity(x, t, labels):
            return FlowDenoiser().logits(trainer, Noised(x, t, labels), torch.device("cpu"))

        rows = [again, both[0][0], both[1][0]]
        with torch.no_grad():
            recomputed = step_logprobs(
                velocity,
                torch.stack([torch.from_numpy(r.latents) for r in rows]),
                torch.tensor([r.label for r in rows]),
                again.recorded_steps,
                SamplingSettings(**{**vars(SDE), "any_label": 10}),
            )
        recorded = torch.tensor([r.logprobs for r in rows])
        assert (recomputed - recorded).abs().max().item() <= 1e-5
    finally:
        await engine.close()


async def test_weights_arrive_between_steps_and_aborts_answer_abort(model_path) -> None:
    engine = DiffusionEngine(model_path)
    await engine.start()
    try:
        long = SamplingSettings(steps=400, eta=0.5, sde_window=(0, 399))
        running = asyncio.ensure_future(
            engine.generate_images(requests("long", ["5", "6"], [0, 1]), long)
        )
        while engine.running == 0:
            await asyncio.sleep(0.01)
        new = {n: p + 0.01 for n, p in engine.model.named_parameters()}
        seconds = await asyncio.wait_for(engine.update_weights(new, 1), 60)
        assert seconds >= 0 and engine.version == 1
        assert engine.abort(["long-1"]) == 1
        first, second = await asyncio.wait_for(running, 120)
        versions = first.policy_versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert first.finish_reason == "stop" and second.finish_reason == "abort"
        with pytest.raises(ValueError, match="not newer"):
            await engine.update_weights(new, 1)
    finally:
        await engine.close()


async def test_bad_requests_are_refused_with_the_reason(model_path) -> None:
    engine = DiffusionEngine(model_path)
    await engine.start()
    try:
        for bad, settings, message in (
            (requests("x", ["a cat"], [0]), SDE, "not a digits prompt"),
            (requests("x", ["3", "3"], [0, 1])[:1] * 2, SDE, "already in flight"),
            ([], SDE, "no images"),
            (requests("x", ["3"], [0]), SamplingSettings(steps=5000), "steps must lie"),
            (requests("x", ["3"], [0]), SamplingSettings(guidance=float("nan")), "finite"),
        ):
            with pytest.raises(RequestError, match=message):
                await engine.generate_images(bad, settings)
        with pytest.raises(RequestError, match="GenerateImages"):
            await engine.generate("t", [1, 2], None)
        # Still serving.
        assert len(await engine.generate_images(requests("ok", ["1"], [0]), SDE)) == 1
    finally:
        await engine.close()


def test_a_folder_that_is_not_a_diffusion_model_is_refused(tiny_model_path) -> None:
    with pytest.raises(ValueError, match="no diffusion model folder"):
        DiffusionEngine(tiny_model_path)


async def test_generate_images_over_grpc_and_a_token_engine_refuses_it(
    model_path, tiny_model_path, start_service
) -> None:
    import grpc

    from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
    from rollwire.rollout.server.hf_engine import HFEngine
    from rollwire.services.core.wire import array_from_bytes
    from tests.helpers.servers import serve_engine

    address, _ = await serve_engine(start_service, DiffusionEngine(model_path))
    sampling = rollout_pb2.ImageSampling(steps=6, eta=0.8, sde_first=1, sde_last=5)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = await stub.GenerateImages(
            rollout_pb2.GenerateImagesRequest(
                request_id="g", prompts=["3", "any"], seeds=[7, 8], sampling=sampling
            )
        )
        first = reply.samples[0]
        image = array_from_bytes(first.image, "image")
        latents = array_from_bytes(first.latents, "latents")
        assert first.request_id == "g/0" and image.shape == (1, 8, 8)
        assert latents.shape == (5, 1, 8, 8) and list(first.recorded_steps) == [1, 2, 3, 4]
        assert len(first.logprobs) == 4 and [s.label for s in reply.samples] == [3, 10]
        status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
        assert status.engine == "diffusion"
        for prompts, seeds, message in (
            (["cat"], [0], "not a digits prompt"),
            (["3"], [], "seeds"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GenerateImages(
                    rollout_pb2.GenerateImagesRequest(
                        request_id="bad", prompts=prompts, seeds=seeds, sampling=sampling
                    )
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in refused.value.details()
    address, _ = await serve_engine(start_service, HFEngine(tiny_model_path, max_batch_size=2))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GenerateImages(
                rollout_pb2.GenerateImagesRequest(request_id="x", prompts=["3"], seeds=[0])
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_denoise_over_grpc_is_the_guided_clean_prediction_and_refuses_bad_input(
    model_path, tiny_model_path, start_service
) -> None:
    import grpc
    import numpy as np

    from rollwire.diffusion.digits import load_unet, velocity
    from rollwire.diffusion.distill import clean_of
    from rollwire.diffusion.sampling import guided
    from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
    from rollwire.rollout.server.hf_engine import HFEngine
    from rollwire.services.core.wire import array_bytes, array_from_bytes
    from tests.helpers.servers import serve_engine

    address, _ = await serve_engine(start_service, DiffusionEngine(model_path))
    latents = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    times, labels = [0.9, 0.5, 0.1], [3, 7, 10]
    unet = load_unet(model_path)
    field = guided(lambda x, t, y: velocity(unet, x, t, y), 2.5, 10)
    with torch.no_grad():
        t = torch.tensor(times)
        expected = clean_of(latents, field(latents, t, torch.tensor(labels)), t).numpy()
        unguided = clean_of(latents, velocity(unet, latents, t, torch.tensor(labels)), t).numpy()

    def request(**changes) -> rollout_pb2.DenoiseRequest:
        fields = {
            "request_id": "d",
            "latents": array_bytes(latents.numpy()),
            "times": times,
            "labels": labels,
            "guidance": 2.5,
        }
        return rollout_pb2.DenoiseRequest(**{**fields, **changes})

    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = await stub.Denoise(request())
        assert np.allclose(array_from_bytes(reply.clean, "clean"), expected, atol=1e-5)
        for changes, message in (
            ({"times": [0.5, 1.5, 0.1]}, "times must lie"),
            ({"labels": [3, 7]}, "3 latents, 3 times, 2 labels"),
            ({"labels": [3, 7, 11]}, "labels must lie"),
            ({"latents": array_bytes(np.zeros((2, 1, 4, 4)))}, "latents must be"),
            ({"latents": b"\x00junk"}, "not valid msgpack"),
            ({"guidance": float("nan")}, "guidance must be"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Denoise(request(**changes))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, changes
            assert message in refused.value.details(), refused.value.details()
        # Still serving, and unguided (0 or 1) is the plain velocity's prediction.
        plain = array_from_bytes((await stub.Denoise(request(guidance=0.0))).clean, "clean")
        assert np.allclose(plain, unguided, atol=1e-5) and not np.allclose(plain, expected)
    address, _ = await serve_engine(start_service, HFEngine(tiny_model_path, max_batch_size=2))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Denoise(request())
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
