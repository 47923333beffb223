"""Generation with a Hugging Face causal LM, batching concurrent requests together.

Requests that arrive while the engine is busy, or within `batch_wait_seconds`
of each other, are generated as one left-padded batch with a KV cache; each row
keeps its own sampling parameters, stop tokens, length limit and seed.

All model work runs on one worker thread, so a weight swap never overlaps a
forward pass and no request sees half a model.

Weight updates interrupt (`interruptible=True`, the default): an update that
arrives while a batch is generating does not wait for it to finish. Between
two decoding steps the worker copies the new weights in, recomputes the KV
cache of every row (prompt and tokens so far) under them, and goes on; the
tokens already generated are kept. Every token is tagged with the version that
produced it, so one response can hold tokens of two versions (a partial
rollout), and its logprobs are those of the weights that chose each token.
With `interruptible=False` an update waits for the batch in flight to end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollwire.rollout.sampling import SamplingSpec, sample_next

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as given (empty prompt, bad ids, too long)."""


class ContextTooLong(RequestError):
    """Prompt plus max_new_tokens exceeds the model's context."""


@dataclass
class Generation:
    """The result of one request."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    policy_version: int
    queue_seconds: float
    generate_seconds: float


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    future: asyncio.Future[Generation]
    enqueued: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)


class HFEngine:
    """A transformers model behind an asyncio interface with dynamic batching."""

    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        max_batch_size: int = 32,
        batch_wait_seconds: float = 0.002,
        dtype: str = "float32",
        device: str = "cpu",
        initial_version: int = 0,
        interruptible: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from rollwire.rollout.tiny import quiet_transformers

        quiet_transformers()
        path = Path(model_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"no Hugging Face model at {path}: expected a folder with config.json and weights "
                "(set rollout_server.model_path, or leave it unset for the built-in tiny model)"
            )
        self.model_path = path
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
            .to(device)
            .eval()
        )
        self.device = torch.device(device)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        self.max_batch_size = max_batch_size
        self.batch_wait_seconds = batch_wait_seconds
        self._version = initial_version
        self.interruptible = interruptible
        # A weight update waiting for the generation loop's next step (worker thread).
        self._update_lock = threading.Lock()
        self._generating = False
        self._pending_update: (
            tuple[dict[str, torch.Tensor], int, concurrent.futures.Future[float]] | None
        ) = None
        self.interrupted_batches = 0
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._inflight: dict[str, _Pending] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self.generated_tokens = 0
        self.running = 0

    # ------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self._version

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every parameter a weight update may set."""
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    async def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(
            self._batch_loop(), name="batch-loop"
        )

    async def close(self) -> None:
        """Aborts what is in flight and stops the worker."""
        self._closed = True
        self.abort(all_requests=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the engine is shutting down"))
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ requests

    def validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Raises RequestError for a request that cannot be served."""
        if not prompt_ids:
            raise RequestError("prompt_token_ids is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if spec.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1")
        if spec.temperature < 0 or not 0 <= spec.top_p <= 1 or spec.top_k < 0:
            raise RequestError("temperature must be >= 0, top_p in [0, 1] and top_k >= 0")
        if len(prompt_ids) + spec.max_new_tokens > self.max_context:
            raise ContextTooLong(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {spec.max_new_tokens} "
                f"exceeds the model's context of {self.max_context}"
            )

    async def generate(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec
    ) -> Generation:
        """Generates one continuation; waits in the queue with other requests for a batch."""
        if self._closed:
            raise RuntimeError("the engine is shutting down")
        self.validate(prompt_ids, spec)
        pending = _Pending(
            request_id, list(prompt_ids), spec, asyncio.get_running_loop().create_future()
        )
        if request_id in self._inflight:
            raise RequestError(f"request id {request_id!r} is already in flight")
        self._inflight[request_id] = pending
        try:
            await self._queue.put(pending)
            return await pending.future
        finally:
            self._inflight.pop(request_id, None)

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        """Marks requests aborted; they return with finish reason "abort" and their tokens so far."""
        targets = (
            list(self._inflight.values())
            if all_requests
            else [self._inflight[r] for r in request_ids if r in self._inflight]
        )
        for pending in targets:
            pending.aborted.set()
        return len(targets)

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """Copies new weights in and sets the version; returns seconds spent copying.

        While a batch generates (and the engine is interruptible) the copy happens
        between two of its decoding steps; otherwise between batches.
        """
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )
        waiting: concurrent.futures.Future[float] | None = None
        with self._update_lock:
            if self.interruptible and self._generating:
                waiting = concurrent.futures.Future()
                if self._pending_update is not None:
                    self._pending_update[2].set_exception(
                        ValueError(f"version {self._pending_update[1]} was superseded by {version}")
                    )
                self._pending_update = (tensors, version, waiting)
        if waiting is not None:
            return await asyncio.wrap_future(waiting)
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self._apply_weights, tensors, version
        )

    def _take_update(self) -> bool:
        """Applies the update waiting for the generation loop, if any (worker thread)."""
        with self._update_lock:
            pending, self._pending_update = self._pending_update, None
        if pending is None:
            return False
        tensors, version, done = pending
        try:
            done.set_result(self._apply_weights(tensors, version))
        except Exception as error:  # a bad tensor fails the update, not the batch
            done.set_exception(error)
            return False
        return True

    # ------------------------------------------------------------ worker side

    def _apply_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )
        started = time.perf_counter()
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors.items():
                parameters[name].copy_(tensor)
        self._version = version
        return time.perf_counter() - started

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Idle until work arrives: this wait is the engine's resting state.
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_wait_seconds
            while len(batch) < self.max_batch_size:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            self.running = len(batch)
            try:
                results = await loop.run_in_executor(self._worker, self._generate_batch, batch)
            except Exception as error:  # a model failure fails this batch, not the engine
                log.exception("generation failed", extra={"batch_size": len(batch)})
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(error)
                continue
            finally:
                self.running = 0
            for pending, result in zip(batch, results, strict=True):
                if not pending.future.done():
                    pending.future.set_result(result)

    def _generate_batch(self, batch: list[_Pending]) -> list[Generation]:
        with self._update_lock:
            self._generating = True
        try:
            return self._decode(batch)
        finally:
            with self._update_lock:
                self._generating = False
            self._take_update()  # one that came after the last step: applied before the next batch

    @torch.inference_mode()
    def _decode(self, batch: list[_Pending]) -> list[Generation]:
        started = time.monotonic()
        size = len(batch)
        longest = max(len(p.prompt_ids) for p in batch)
        input_ids = torch.full((size, longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((size, longest), dtype=torch.long)
        for row, pending in enumerate(batch):
            input_ids[row, longest - len(pending.prompt_ids) :] = torch.tensor(pending.prompt_ids)
            attention[row, longest - len(pending.prompt_ids) :] = 1
        specs = [p.spec for p in batch]
        generators: list[torch.Generator | None] = []
        for pending in batch:
            generator = None
            if pending.spec.seed is not None:
                generator = torch.Generator()
                generator.manual_seed(pending.spec.seed)
            generators.append(generator)
        outputs: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        versions: list[list[int]] = [[] for _ in batch]
        finish: list[str | None] = [None] * size
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        cache = None
        step_ids, step_positions = input_ids, positions
        sequence = input_ids  # every row's prompt and tokens so far, for a cache rebuild
        version = self._version
        interrupted = False
        for _ in range(max(p.spec.max_new_tokens for p in batch)):
            if self._pending_update is not None and self._take_update():
                # New weights mid-batch: rebuild every row's cache under them, keep the tokens.
                version = self._version
                interrupted = True
                cache = None
                step_ids = sequence
                step_positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
            out = self.model(
                input_ids=step_ids.to(self.device),
                attention_mask=attention.to(self.device),
                position_ids=step_positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            tokens, chosen = sample_next(out.logits[:, -1, :].cpu(), specs, generators)
            for row, pending in enumerate(batch):
                if finish[row] is not None:
                    continue
                if pending.aborted.is_set():
                    finish[row] = "abort"
                    continue
                token = int(tokens[row])
                outputs[row].append(token)
                logprobs[row].append(float(chosen[row]))
                versions[row].append(version)
                if token in pending.spec.stop_token_ids:
                    finish[row] = "stop"
                elif len(outputs[row]) >= pending.spec.max_new_tokens:
                    finish[row] = "length"
            if all(reason is not None for reason in finish):
                break
            step_ids = tokens[:, None]
            sequence = torch.cat([sequence, step_ids], dim=1)
            attention = torch.cat([attention, torch.ones((size, 1), dtype=torch.long)], dim=1)
            step_positions = step_positions[:, -1:] + 1
        elapsed = time.monotonic() - started
        self.generated_tokens += sum(len(o) for o in outputs)
        self.interrupted_batches += interrupted
        return [
            Generation(
                token_ids=outputs[row],
                logprobs=logprobs[row],
                policy_versions=versions[row],
                finish_reason=finish[row] or "length",
                policy_version=version,
                queue_seconds=started - pending.enqueued,
                generate_seconds=elapsed,
            )
            for row, pending in enumerate(batch)
        ]
