"""The diffusion engine: samples images from a class-conditional flow-matching denoiser
(the flow-denoiser family's folders, e.g. the built-in digits model) for the rollout-server's
`GenerateImages`, recording the SDE steps Flow-GRPO trains on.

Requests (a prompt such as "3" or "any" and a seed each) that arrive together and share
sampling settings run as one batch, up to `max_batch_size` rows, on one worker thread
(`rollwire.diffusion.sampling.sample`: each row from its own seed, so a sample does not
depend on its batch). New weights are taken between two denoising steps, as the language
engines take them between two tokens: every recorded step says which version took it.
An aborted request's batch finishes; the request is answered "abort" and trains nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.diffusion.data import label_of
from rollwire.diffusion.digits import velocity
from rollwire.diffusion.sampling import SamplingSettings, sample
from rollwire.rollout.server.engine import RequestError, ScoreUnsupported
from rollwire.rollout.server.requests import InFlight

log = logging.getLogger(__name__)

MARKER = "rollwire_diffusion.json"
MAX_STEPS = 1000


@dataclass
class _Held:
    """A request in flight: whether it was aborted."""

    aborted: bool = False


@dataclass
class ImageRequest:
    request_id: str
    prompt: str
    seed: int


@dataclass
class ImageGeneration:
    """One request's image and what Flow-GRPO needs of its sampling."""

    image: np.ndarray
    """float32 [C, H, W] at t = 0, clipped to the model's value range."""
    latents: np.ndarray
    """float32 [R + 1, C, H, W]: before each recorded step, then after the last (as
    sampled, not clipped: what the trainer recomputes the steps from)."""
    recorded_steps: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    label: int
    finish_reason: str
    """"stop", or "abort"."""
    policy_version: int
    queue_seconds: float
    generate_seconds: float


def validate_settings(settings: SamplingSettings) -> None:
    """RequestError for settings no request may ask for."""
    if not 1 <= settings.steps <= MAX_STEPS:
        raise RequestError(f"steps must lie in [1, {MAX_STEPS}], got {settings.steps}")
    for name in ("eta", "shift", "guidance"):
        value = getattr(settings, name)
        if not np.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}")
    if settings.shift <= 0:
        raise RequestError(f"shift must be positive, got {settings.shift}")


class DiffusionEngine:
    """See the module docstring. `generate` (token prompts) is not this engine's."""

    name = "diffusion"

    def __init__(
        self,
        model_path: str | Path,
        max_batch_size: int = 64,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        from diffusers import UNet2DModel

        self.model_path = Path(model_path)
        info_path = self.model_path / MARKER
        if not info_path.exists():
            raise ValueError(
                f"{self.model_path} is no diffusion model folder (no {MARKER}); the diffusion "
                "engine serves the flow-denoiser family's folders"
            )
        self.info = json.loads(info_path.read_text())
        self.image_shape = tuple(self.info["image_shape"])
        self.value_range = tuple(self.info.get("value_range", (-1.0, 1.0)))
        self.any_label = int(self.info.get("any_label", len(self.info["labels"]) - 1))
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.model = (
            UNet2DModel.from_pretrained(self.model_path, torch_dtype=self.dtype)
            .to(self.device)
            .eval()
            .requires_grad_(False)
        )
        self.max_batch_size = max_batch_size
        self.generated_tokens = 0
        """Denoising steps taken, summed over samples (the status's token counter)."""
        self._version = 0
        self._weights_lock = threading.Lock()
        self._pending: tuple[dict[str, torch.Tensor], int, asyncio.Future, Any] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")
        self._threads = torch.get_num_threads()
        self._in_flight: InFlight[_Held] = InFlight(_mark_aborted)
        self._queue: list[
            tuple[list[ImageRequest], SamplingSettings, asyncio.Future, float, list[_Held]]
        ] = []
        self._arrived = asyncio.Event()
        self._running_rows = 0
        self._loop_task: asyncio.Task | None = None
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ status

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return self._running_rows

    @property
    def waiting(self) -> int:
        return sum(len(requests) for requests, *_ in self._queue)

    @property
    def threads(self) -> int:
        return self._threads

    def set_threads(self, threads: int) -> str | None:
        self._worker.submit(torch.set_num_threads, threads)
        self._threads = threads
        return None

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------- generation

    async def generate(self, request_id: str, prompt_ids: list[int], spec: Any) -> Any:
        raise RequestError("the diffusion engine generates images: call GenerateImages")

    async def score(self, sequences: Any, top_k: int) -> Any:
        raise ScoreUnsupported("the diffusion engine scores no tokens")

    def label(self, prompt: str) -> int:
        """The class label a prompt names (RequestError if it names none)."""
        try:
            return label_of(prompt)
        except ValueError as error:
            raise RequestError(str(error)) from None

    async def generate_images(
        self, requests: list[ImageRequest], settings: SamplingSettings
    ) -> list[ImageGeneration]:
        """Samples every request (see the module docstring)."""
        if not requests:
            raise RequestError("no images requested")
        validate_settings(settings)
        for request in requests:
            self.label(request.prompt)
        with contextlib.ExitStack() as stack:
            # A duplicate id, in flight or twice in this call, is refused.
            held = [
                stack.enter_context(self._in_flight.hold(r.request_id, _Held)) for r in requests
            ]
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            self._queue.append((requests, settings, future, time.monotonic(), held))
            self._arrived.set()
            return await future

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        return self._in_flight.abort(request_ids, all_requests)

    async def denoise(
        self, latents: np.ndarray, times: list[float], labels: list[int], guidance: float
    ) -> tuple[np.ndarray, int]:
        """The clean predictions x_t - t v of `latents` [B, C, H, W] at `times` for
        `labels`, with classifier-free `guidance` (what a DMD trainer asks of its frozen
        teacher), on the sampling thread between two batches; and the version that
        computed them. RequestError for bad input."""
        count = len(latents)
        if count == 0 or tuple(latents.shape[1:]) != self.image_shape:
            raise RequestError(
                f"latents must be [B, {', '.join(map(str, self.image_shape))}] with B >= 1, "
                f"got {list(latents.shape)}"
            )
        if len(times) != count or len(labels) != count:
            raise RequestError(f"{count} latents, {len(times)} times, {len(labels)} labels")
        if not all(0.0 <= t <= 1.0 for t in times):
            raise RequestError("times must lie in [0, 1]")
        if not all(0 <= label <= self.any_label for label in labels):
            raise RequestError(f"labels must lie in [0, {self.any_label}]")
        if not np.isfinite(latents).all():
            raise RequestError("latents must be finite")
        if not (np.isfinite(guidance) and guidance >= 0):
            raise RequestError(f"guidance must be a finite number >= 0, got {guidance}")
        x = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))
        t = torch.tensor(times, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.long)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._denoise, x, t, y, guidance or 1.0)

    def _denoise(
        self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, guidance: float
    ) -> tuple[np.ndarray, int]:
        from rollwire.diffusion.sampling import guided

        x = x.to(self.device, self.dtype)
        t = t.to(self.device, self.dtype)
        field = guided(self._velocity, guidance, self.any_label)
        with torch.no_grad():
            clean = x - t.reshape(-1, 1, 1, 1) * field(x, t, labels.to(self.device))
        self.generated_tokens += len(x)
        return clean.float().cpu().numpy(), self._step_version

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            first_settings = self._queue[0][1]
            taken, rows = [], 0
            for item in list(self._queue):
                if item[1] == first_settings and rows + len(item[0]) <= max(
                    self.max_batch_size, len(self._queue[0][0])
                ):
                    taken.append(item)
                    rows += len(item[0])
            for item in taken:
                self._queue.remove(item)
            self._running_rows = rows
            try:
                results = await loop.run_in_executor(
                    self._worker, self._sample_batch, taken, first_settings, loop
                )
            except Exception as error:  # the batch's callers get the error; the engine goes on
                log.exception("a diffusion batch failed")
                for _, _, future, _, _ in taken:
                    if not future.done():
                        future.set_exception(error)
                continue
            finally:
                self._running_rows = 0
                # An update that came during the batch's last step is taken now, not at
                # the next batch (there may be none).
                await loop.run_in_executor(self._worker, self._take_update)
            for (_, _, future, _, _), result in zip(taken, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _velocity(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The denoiser's velocity; takes a waiting weight update first (worker thread)."""
        self._take_update()
        with self._weights_lock:
            self._step_version = self._version
            return velocity(self.model, x, t, labels)

    def _sample_batch(
        self, taken: list, settings: SamplingSettings, loop: asyncio.AbstractEventLoop
    ) -> list[list[ImageGeneration]]:
        started = time.monotonic()
        requests = [request for requests, *_ in taken for request in requests]
        labels = torch.tensor([self.label(request.prompt) for request in requests])
        settings = dataclasses.replace(settings, any_label=self.any_label)
        with torch.no_grad():
            out = sample(
                self._velocity,
                labels,
                [request.seed for request in requests],
                settings,
                shape=self.image_shape,
                device=self.device,
                dtype=self.dtype,
                version=lambda: self._step_version,
            )
        self.generated_tokens += len(requests) * settings.steps
        seconds = time.monotonic() - started
        low, high = self.value_range  # as diffusers' pipelines, the image is clipped to it
        images = out.images.float().clamp(low, high).cpu().numpy()
        latents = out.latents.float().cpu().numpy()
        logprobs = out.logprobs.float().cpu().numpy()
        results, row = [], 0
        for _, _, _, arrived, held in taken:
            answers = []
            for state in held:
                answers.append(
                    ImageGeneration(
                        image=images[row],
                        latents=latents[row],
                        recorded_steps=out.recorded_steps,
                        logprobs=logprobs[row].tolist(),
                        policy_versions=list(out.versions),
                        label=int(labels[row]),
                        finish_reason="abort" if state.aborted else "stop",
                        policy_version=self._version,
                        queue_seconds=started - arrived,
                        generate_seconds=seconds,
                    )
                )
                row += 1
            results.append(answers)
        return results

    # ----------------------------------------------------------------- weights

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """Copies new weights in between two denoising steps (or at once when idle) and
        sets the version; returns seconds spent copying."""
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )
        loop = asyncio.get_running_loop()
        if self._running_rows:
            future = loop.create_future()
            with self._weights_lock:
                if self._pending is not None:
                    superseded = self._pending
                    superseded[3].call_soon_threadsafe(
                        _fail,
                        superseded[2],
                        ValueError(f"version {superseded[1]} was superseded by {version}"),
                    )
                self._pending = (tensors, version, future, loop)
            if not self._running_rows:  # the batch ended meanwhile: take it here
                await loop.run_in_executor(self._worker, self._take_update)
            return await future
        return await loop.run_in_executor(self._worker, self._apply, tensors, version)

    def _take_update(self) -> None:
        with self._weights_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        tensors, version, future, loop = pending
        try:
            seconds = self._apply(tensors, version)
        except Exception as error:  # a bad tensor fails the update, not the batch
            loop.call_soon_threadsafe(_fail, future, error)
            return
        loop.call_soon_threadsafe(_succeed, future, seconds)

    def _apply(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        started = time.perf_counter()
        parameters = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(parameters))
        if unknown:
            raise ValueError(f"weights this model has no place for: {unknown[:5]}")
        with self._weights_lock, torch.no_grad():
            if version <= self._version:
                raise ValueError(
                    f"version {version} is not newer than the served version {self._version}"
                )
            for name, tensor in tensors.items():
                parameters[name].copy_(tensor)
            self._version = version
        return time.perf_counter() - started


def _mark_aborted(held: list[_Held]) -> None:
    for request in held:
        request.aborted = True


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _succeed(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
