"""The rollout-server: `rollwire.v1.RolloutService` over one generation engine."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import time
from typing import Any

import grpc
import grpc.aio

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.engine import (
    ContextTooLong,
    Engine,
    RequestError,
    ScoreUnsupported,
    UpdateUnsupported,
)
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.rollout.server.weights import (
    NotInWeightGroup,
    WeightGroupError,
    WeightGroupRequestError,
    WeightReceiver,
    WeightStreamError,
)
from rollwire.services.core.config import ClientConfig, RolloutServerConfig
from rollwire.services.core.images import ImageError, ImageLimits, ImageRef, of_protos
from rollwire.services.core.metrics import COUNTERS, GAUGES
from rollwire.services.core.server import Registration, reject
from rollwire.services.core.tokenizer import tokenizer_digest
from rollwire.services.core.watchdog import Watchdog

log = logging.getLogger(__name__)
SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
FINISH_REASONS = {
    "stop": rollout_pb2.FINISH_REASON_STOP,
    "length": rollout_pb2.FINISH_REASON_LENGTH,
    "abort": rollout_pb2.FINISH_REASON_ABORT,
}


def sampling_spec(params: rollout_pb2.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=frozenset(params.stop_token_ids),
        seed=params.seed if params.HasField("seed") else None,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate, Abort, GetStatus and the weight calls over an engine; the weight calls
    are a `WeightReceiver`'s, their errors mapped to gRPC status codes here."""

    def __init__(
        self,
        engine: Engine,
        await_weights: bool = False,
        watch_seconds: float = 300.0,
        weights_from: str | None = None,
        client: ClientConfig | None = None,
        fetch_seconds: float = 120.0,
    ) -> None:
        """`weights_from`: a trainer to fetch the newest version from now (within
        `fetch_seconds`, calling it with `client`'s settings), requests held meanwhile."""
        self.engine = engine
        self._started = False
        self.watchdog = Watchdog("rollout-server")
        self.watch_seconds = watch_seconds
        self.weights = WeightReceiver(engine)
        # Set when the engine broke for good: the process then exits 1 (and is restarted).
        self.fatal = asyncio.Event()
        self._tokenizer_digest: str | None = None
        self._has_weights = asyncio.Event()
        self.fetching: asyncio.Task[None] | None = None
        if weights_from is not None:
            self.fetching = asyncio.get_running_loop().create_task(
                self._fetch(weights_from, client or ClientConfig(), fetch_seconds, await_weights),
                name="weights-fetch",
            )
        elif not await_weights:
            self._has_weights.set()
        for name, read, help in (
            ("rollout_policy_version", lambda: engine.version, "the weights' version served"),
            ("rollout_running_requests", lambda: engine.running, "requests generating now"),
            ("rollout_waiting_requests", lambda: engine.waiting, "requests queued"),
            ("rollout_generated_tokens", lambda: engine.generated_tokens, "tokens generated"),
        ):
            GAUGES.register(name, read, help)

    async def _fetch(
        self, address: str, client: ClientConfig, patience: float, await_weights: bool
    ) -> None:
        from rollwire.rollout.server.fetch import fetch_newest

        try:
            await self._start()
            # Without await_weights, a trainer that does not answer lets requests go on.
            release = None if await_weights else self._has_weights.set
            fetched = await fetch_newest(self.weights, address, client, patience, release)
            if fetched or not await_weights:
                self._has_weights.set()
        except Exception:  # a failed fetch must not stop the server: it serves what it has
            log.exception("fetching weights from %s failed", address)
            if not await_weights:
                self._has_weights.set()

    async def _wait_for_weights(self, context: grpc.aio.ServicerContext) -> None:
        """Holds a request until the trainer's weights arrive, within its deadline."""
        if self._has_weights.is_set():
            return
        remaining = context.time_remaining()
        patience = 60.0 if remaining is None else max(remaining - 0.5, 0.0)
        COUNTERS.inc("rollout_held_for_weights")
        try:
            await asyncio.wait_for(self._has_weights.wait(), patience)
        except TimeoutError:
            await self._reject(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "awaiting_weights",
                f"this rollout-server was restarted and still waits for the trainer's weights "
                f"(it holds version {self.engine.version}); try again shortly",
            )

    async def _start(self) -> None:
        """Starts the engine and the watchdog at the first request."""
        if not self._started:
            self._started = True
            await self.engine.start()
            self.watchdog.start()

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str
    ) -> None:
        await reject(context, "rollout", code, reason, message)

    async def _generate(
        self,
        request_id: str,
        prompt: list[int],
        spec: SamplingSpec,
        context: grpc.aio.ServicerContext,
        images: list[ImageRef] = (),
    ) -> rollout_pb2.GenerateResponse:
        await self._wait_for_weights(context)
        await self._start()
        try:
            shown = self._image_args(images)
            with self.watchdog.watch("request", request_id, self.watch_seconds):
                result = await self.engine.generate(request_id, prompt, spec, *shown)
        except ContextTooLong as error:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "context", str(error))
        except RequestError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        except RuntimeError as error:
            if getattr(self.engine, "failure", None) is not None and not self.fatal.is_set():
                log.error("the engine failed; this rollout-server exits to be started again")
                self.fatal.set()
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "shutting_down", str(error))
        COUNTERS.inc("rollout_generated_tokens", amount=len(result.token_ids))
        return rollout_pb2.GenerateResponse(
            request_id=request_id,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            policy_versions=result.policy_versions,
            finish_reason=FINISH_REASONS[result.finish_reason],
            policy_version=result.policy_version,
            queue_seconds=result.queue_seconds,
            generate_seconds=result.generate_seconds,
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        spec = sampling_spec(request.sampling)
        images = await self._images(request.images, context)
        return await self._generate(
            request.request_id, list(request.prompt_token_ids), spec, context, images
        )

    async def _images(self, messages: Any, context: grpc.aio.ServicerContext) -> list[ImageRef]:
        """A request's `Image` messages; INVALID_ARGUMENT for one that is neither bytes
        nor a reference."""
        try:
            return of_protos(messages)
        except ImageError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_image", str(error))

    def _image_args(self, images: list) -> tuple:
        """What an engine call gets for `images` (one list, or one per sequence): nothing
        when there are none, as every engine is called; the images for an engine that
        takes them; RequestError for one that takes none."""
        if not any(images):
            return ()
        if not hasattr(self.engine, "image_features"):
            raise RequestError(f"the {self.engine.name} engine takes no images")
        return (images,)

    async def GenerateGroup(
        self, request: rollout_pb2.GenerateGroupRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateGroupResponse:
        if not 1 <= request.num_samples <= 1024:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_request",
                "num_samples must lie in [1, 1024]",
            )
        prompt, spec = list(request.prompt_token_ids), sampling_spec(request.sampling)
        images = await self._images(request.images, context)
        # Seeded groups: sample i draws from seed + i, so samples differ and repeat by index.
        specs = [
            spec if spec.seed is None else dataclasses.replace(spec, seed=spec.seed + i)
            for i in range(request.num_samples)
        ]
        samples = await asyncio.gather(
            *(
                self._generate(f"{request.request_id}/{i}", prompt, specs[i], context, images)
                for i in range(request.num_samples)
            )
        )
        return rollout_pb2.GenerateGroupResponse(samples=samples)

    async def GenerateImages(
        self, request: rollout_pb2.GenerateImagesRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateImagesResponse:
        generate_images = getattr(self.engine, "generate_images", None)
        if generate_images is None:
            await self._reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "wrong_engine",
                f"the {self.engine.name} engine generates tokens, not images "
                "(rollout_server.engine: diffusion serves GenerateImages)",
            )
        from rollwire.diffusion.sampling import SamplingSettings
        from rollwire.rollout.server.diffusion_engine import ImageRequest
        from rollwire.services.core.wire import array_bytes

        if len(request.prompts) != len(request.seeds) or not 1 <= len(request.prompts) <= 1024:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_request",
                f"{len(request.prompts)} prompts and {len(request.seeds)} seeds: expected "
                "equal lengths in [1, 1024]",
            )
        sampling = request.sampling
        try:
            settings = SamplingSettings(
                steps=sampling.steps,
                eta=sampling.eta,
                sde_window=(sampling.sde_first, sampling.sde_last),
                shift=sampling.shift or 1.0,
                guidance=sampling.guidance or 1.0,
            )
        except ValueError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        requests = [
            ImageRequest(f"{request.request_id}/{i}", prompt, seed)
            for i, (prompt, seed) in enumerate(zip(request.prompts, request.seeds, strict=True))
        ]
        await self._wait_for_weights(context)
        await self._start()
        try:
            with self.watchdog.watch("request", request.request_id, self.watch_seconds):
                results = await generate_images(requests, settings)
        except RequestError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        samples = [
            rollout_pb2.ImageSample(
                request_id=item.request_id,
                image=array_bytes(result.image),
                latents=array_bytes(result.latents),
                recorded_steps=result.recorded_steps,
                logprobs=result.logprobs,
                policy_versions=result.policy_versions,
                label=result.label,
                finish_reason=FINISH_REASONS[result.finish_reason],
                policy_version=result.policy_version,
                queue_seconds=result.queue_seconds,
                generate_seconds=result.generate_seconds,
            )
            for item, result in zip(requests, results, strict=True)
        ]
        return rollout_pb2.GenerateImagesResponse(samples=samples)

    async def Denoise(
        self, request: rollout_pb2.DenoiseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.DenoiseResponse:
        denoise = getattr(self.engine, "denoise", None)
        if denoise is None:
            await self._reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "wrong_engine",
                f"the {self.engine.name} engine generates tokens; Denoise is a diffusion "
                "engine's (rollout_server.engine: diffusion)",
            )
        from rollwire.services.core.wire import WireError, array_bytes, array_from_bytes

        started = time.perf_counter()
        try:
            latents = array_from_bytes(request.latents, "latents")
        except WireError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        await self._wait_for_weights(context)
        await self._start()
        try:
            with self.watchdog.watch("denoise", request.request_id, self.watch_seconds):
                clean, version = await denoise(
                    latents, list(request.times), list(request.labels), request.guidance
                )
        except RequestError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        COUNTERS.inc("rollout_denoised_latents", amount=len(clean))
        return rollout_pb2.DenoiseResponse(
            clean=array_bytes(clean),
            policy_version=version,
            seconds=time.perf_counter() - started,
        )

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        return rollout_pb2.AbortResponse(
            aborted=self.engine.abort(list(request.request_ids), all_requests=request.all)
        )

    async def UpdateWeights(
        self, request_iterator, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        try:
            reply = await self.weights.take_stream(request_iterator)
        except WeightStreamError as error:
            await self._reject(
                context, getattr(grpc.StatusCode, error.code), "bad_weights", str(error)
            )
        except ValueError as error:  # a concurrent update got there first
            await self._reject(
                context, grpc.StatusCode.FAILED_PRECONDITION, "stale_version", str(error)
            )
        except UpdateUnsupported as error:
            await self._reject(
                context, grpc.StatusCode.UNIMPLEMENTED, "updates_unsupported", str(error)
            )
        self._has_weights.set()
        return reply

    async def JoinWeightGroup(
        self, request: rollout_pb2.JoinWeightGroupRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.JoinWeightGroupResponse:
        try:
            group = await self.weights.join(request)
        except WeightGroupRequestError as error:  # before ValueError: it is one
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_group", str(error))
        except (WeightGroupError, ValueError) as error:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "group_failed", str(error))
        return rollout_pb2.JoinWeightGroupResponse(device=str(group.device))

    async def ReceiveWeights(
        self, request: rollout_pb2.ReceiveWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        try:
            reply = await self.weights.receive(request)
        except NotInWeightGroup as error:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, "no_group", str(error))
        except WeightStreamError as error:
            await self._reject(
                context, getattr(grpc.StatusCode, error.code), "bad_weights", str(error)
            )
        except WeightGroupError as error:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "group_failed", str(error))
        except ValueError as error:  # a concurrent update got there first
            await self._reject(
                context, grpc.StatusCode.FAILED_PRECONDITION, "stale_version", str(error)
            )
        self._has_weights.set()
        return reply

    async def ScoreTokens(
        self, request: rollout_pb2.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ScoreTokensResponse:
        await self._wait_for_weights(context)
        await self._start()
        sequences = [(list(s.token_ids), int(s.start)) for s in request.sequences]
        images = [await self._images(s.images, context) for s in request.sequences]
        try:
            shown = self._image_args(images)
            with self.watchdog.watch("score", request.request_id, self.watch_seconds):
                scores, version = await self.engine.score(sequences, int(request.top_k), *shown)
        except ContextTooLong as error:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "context", str(error))
        except RequestError as error:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(error))
        except ScoreUnsupported as error:
            await self._reject(
                context, grpc.StatusCode.UNIMPLEMENTED, "score_unsupported", str(error)
            )
        except RuntimeError as error:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "shutting_down", str(error))
        COUNTERS.inc("rollout_scored_tokens", amount=sum(len(s.logprobs) for s in scores))
        return rollout_pb2.ScoreTokensResponse(
            sequences=[
                rollout_pb2.SequenceScores(
                    logprobs=s.logprobs,
                    top_token_ids=[token for row in s.top_token_ids for token in row],
                    top_logprobs=[value for row in s.top_logprobs for value in row],
                )
                for s in scores
            ],
            policy_version=version,
        )

    async def SetThreads(
        self, request: rollout_pb2.SetThreadsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.SetThreadsResponse:
        if request.threads < 1:
            await self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_request",
                f"threads must be at least 1, got {request.threads}",
            )
        reason = self.engine.set_threads(int(request.threads))
        if reason is None:
            COUNTERS.inc("rollout_thread_changes")
            log.info("threads set", extra={"threads": int(request.threads)})
        return rollout_pb2.SetThreadsResponse(
            applied=reason is None, threads=self.engine.threads, reason=reason or ""
        )

    def tokenizer_digest(self) -> str:
        """The served tokenizer's digest (`rollwire.rollout.server.engine.tokenizer_digest`),
        read once."""
        if self._tokenizer_digest is None:
            self._tokenizer_digest = tokenizer_digest(self.engine.model_path)
        return self._tokenizer_digest

    async def GetStatus(
        self, request: rollout_pb2.RolloutStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        return rollout_pb2.RolloutStatus(
            policy_version=self.engine.version,
            engine=self.engine.name,
            model=str(self.engine.model_path),
            running_requests=self.engine.running,
            waiting_requests=self.engine.waiting,
            generated_tokens=self.engine.generated_tokens,
            tokenizer_digest=await asyncio.to_thread(self.tokenizer_digest),
            threads=self.engine.threads,
        )

    async def close(self) -> None:
        if self.fetching is not None:
            self.fetching.cancel()
        self.weights.close()
        self.watchdog.stop()
        await self.engine.close()


# Engines in this process that take the same arguments; imported only when chosen.
IN_PROCESS_ENGINES = {
    "vllm": ("rollwire.rollout.server.vllm_engine", "VLLMEngine"),
    "sglang": ("rollwire.rollout.server.sglang_engine", "SGLangEngine"),
}


def build_engine(config: RolloutServerConfig, image_limits: ImageLimits | None = None) -> Engine:
    """The engine named in the config, loaded and ready; `image_limits` (`image_inputs`):
    what a request's image may be, for an engine serving a vision-language model."""
    import torch

    torch.set_num_threads(config.threads)
    if config.engine == "openai":
        from rollwire.rollout.server.openai_engine import OpenAIEngine

        return OpenAIEngine(
            config.base_url,
            model_path=config.model_path,
            interruptible=config.interruptible,
            dtype=config.dtype,
            **{"seed": config.seed, **config.engine_args},
        )
    model_path = config.model_path
    if config.engine == "diffusion":
        from rollwire.rollout.server.diffusion_engine import DiffusionEngine

        if model_path is None:
            from rollwire.diffusion.digits import digits_model

            model_path = digits_model(threads=config.threads)
        return DiffusionEngine(
            model_path,
            max_batch_size=config.max_batch_size,
            dtype=config.dtype,
            device=config.device,
        )
    if model_path is None:
        from rollwire.services.core.tiny import default_model_path, ensure_tiny_model

        model_path = ensure_tiny_model(default_model_path())
    if config.engine in IN_PROCESS_ENGINES:
        module, name = IN_PROCESS_ENGINES[config.engine]
        engine_class = getattr(importlib.import_module(module), name)
        takes_images = {"image_limits": image_limits} if config.engine == "vllm" else {}
        return engine_class(
            model_path,
            max_batch_size=config.max_batch_size,
            dtype=config.dtype,
            interruptible=config.interruptible,
            seed=config.seed,
            engine_args=config.engine_args,
            **takes_images,
        )
    from rollwire.rollout.server.hf_engine import HFEngine

    return HFEngine(
        model_path,
        max_batch_size=config.max_batch_size,
        batch_wait_seconds=config.batch_wait_seconds,
        batch_max_wait_seconds=config.batch_max_wait_seconds,
        dtype=config.dtype,
        device=config.device,
        interruptible=config.interruptible,
        seed=config.seed,
        image_limits=image_limits,
    )


def registrations(
    config: RolloutServerConfig,
    watch_seconds: float = 300.0,
    image_limits: ImageLimits | None = None,
    client: ClientConfig | None = None,
) -> list[Registration]:
    """What `rollwire rollout-server` hosts (`client`: how it calls the trainer)."""
    servicer = RolloutServicer(
        build_engine(config, image_limits),
        await_weights=config.await_weights,
        watch_seconds=watch_seconds,
        weights_from=config.weights_from,
        client=client,
        fetch_seconds=config.weights_fetch_seconds,
    )
    return [
        Registration(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer, SERVICE_NAME)
    ]
