"""Generation with a Hugging Face causal LM, batching concurrent requests together.

Requests that arrive within `batch_wait_seconds` of each other (up to
`batch_max_wait_seconds` after the first) start as one left-padded batch with a
KV cache; each row keeps its own sampling parameters, stop tokens, length limit
and seed. Batching is continuous: a request that arrives while a batch runs
joins it between two decoding steps (its prompt computed alone and put beside
the running cache; finished rows leave the cache once they are half the batch),
and each request is answered as soon as its own row ends, not when the batch
drains.

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

A vision-language model folder (`rollwire.services.core.vision`) takes requests with
images: each is checked against its prompt's placeholders and processed once when it
arrives (a bad image is a RequestError naming what is wrong), its pixels go into every
forward that computes its prompt (a new batch, a join, a re-layout after new weights),
and its rows get the model's three-dimensional rotary positions there; decoding steps
go on from the last position as text does.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollwire.rollout.server.engine import (
    ContextTooLong,
    Generation,
    RequestError,
    Scores,
    checked_images,
    validate_request,
    validate_scoring,
)
from rollwire.rollout.server.requests import InFlight
from rollwire.rollout.server.sampling import SamplingBatch, SamplingSpec
from rollwire.services.core.images import ImageLimits, ImageRef
from rollwire.services.core.vision import (
    Features,
    VisionSide,
    is_vision_model,
    suppress,
)

__all__ = ["ContextTooLong", "Generation", "HFEngine", "RequestError"]

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    future: asyncio.Future[Generation]
    enqueued: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)
    features: Features | None = None
    """The processed images of the prompt (a vision-language model); None without images."""


class HFEngine:
    """A transformers model behind an asyncio interface with dynamic batching."""

    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        max_batch_size: int = 32,
        batch_wait_seconds: float = 0.002,
        batch_max_wait_seconds: float = 0.05,
        dtype: str = "float32",
        device: str = "cpu",
        initial_version: int = 0,
        interruptible: bool = True,
        seed: int | None = None,
        image_limits: ImageLimits | None = None,
    ) -> None:
        """`seed` (rollout_server.seed) starts the generator requests without a seed of
        their own draw from (unset: torch's global one); a request with a seed draws from
        a generator of its own, whatever it is batched with. `image_limits`: what a
        request's image may be (a vision-language model; `image_inputs`)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from rollwire.services.core.tiny import quiet_transformers

        quiet_transformers()
        path = Path(model_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"no Hugging Face model at {path}: expected a folder with config.json and weights "
                "(set rollout_server.model_path, or leave it unset for the built-in tiny model)"
            )
        self.model_path = path
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.vision = VisionSide(path, image_limits) if is_vision_model(path) else None
        auto = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = torch.device(device)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        text_config = getattr(self.model.config, "text_config", self.model.config)
        self.max_context = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.pad_token_id = int(getattr(text_config, "pad_token_id", None) or 0)
        self.max_batch_size = max_batch_size
        self.batch_wait_seconds = batch_wait_seconds
        self.batch_max_wait_seconds = max(batch_max_wait_seconds, batch_wait_seconds)
        self._version = initial_version
        self.interruptible = interruptible
        # A weight update waiting for the generation loop's next step (worker thread).
        self._update_lock = threading.Lock()
        self._generating = False
        self._pending_update: (
            tuple[dict[str, torch.Tensor], int, concurrent.futures.Future[float]] | None
        ) = None
        self.interrupted_batches = 0
        self._draining = False
        # Requests not yet in a batch. A deque (thread-safe appends and pops): the batch
        # loop takes new batches from it, the worker takes rows joining a running batch.
        self._intake: collections.deque[_Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.joined_rows = 0
        self.layouts = 0
        """Batches laid out with a fresh KV cache: each new batch, and each weight update
        mid-batch (and a join whose cache could not be edited)."""
        self.cache_merges = 0
        """Changes of rows made on the running KV cache (joins, finished rows dropped)."""
        self._inflight: InFlight[_Pending] = InFlight(self._stop)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._threads = torch.get_num_threads()  # the worker starts with the process's
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self.generated_tokens = 0
        self.running = 0
        self._aborts = 0
        """Counts abort calls: the decoding loop looks at its rows' abort flags only after one."""
        # Prefill computes logits for the last position only, where the model's forward
        # takes `logits_to_keep` (the vocabulary projection of every prompt token is waste).
        forward = inspect.signature(self.model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    # ------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self._version

    @property
    def waiting(self) -> int:
        return len(self._intake)

    @property
    def threads(self) -> int:
        return self._threads

    def set_threads(self, threads: int) -> str | None:
        """Takes effect on the worker thread (torch's thread count is per thread) once
        the batch it is running ends: a job queued behind it."""
        if threads != self._threads:
            self._threads = threads
            self._worker.submit(torch.set_num_threads, threads)
        return None

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every parameter a weight update may set."""
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_task = asyncio.get_running_loop().create_task(
            self._batch_loop(), name="batch-loop"
        )

    async def close(self) -> None:
        """Aborts what is in flight and stops the worker."""
        self._closed = True
        self.abort(all_requests=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
        while self._intake:
            pending = self._intake.popleft()
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the engine is shutting down"))
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ requests

    def validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Raises RequestError for a request that cannot be served."""
        validate_request(prompt_ids, spec, self.vocab_size, self.max_context)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        spec: SamplingSpec,
        images: list[ImageRef] = (),
    ) -> Generation:
        """Generates one continuation; waits in the queue with other requests for a batch.
        `images`: those the prompt's placeholders stand for (a vision-language model)."""
        if self._closed:
            raise RuntimeError("the engine is shutting down")
        self.validate(prompt_ids, spec)
        features = await self.image_features(prompt_ids, images)
        loop = asyncio.get_running_loop()
        with self._inflight.hold(
            request_id,
            lambda: _Pending(
                request_id, list(prompt_ids), spec, loop.create_future(), features=features
            ),
        ) as pending:
            try:
                self._intake.append(pending)
                self._arrived.set()
                return await pending.future
            except asyncio.CancelledError:  # the caller went away (deadline, hang-up): stop it
                self._stop([pending])
                raise

    async def image_features(self, token_ids: list[int], images: list[ImageRef]) -> Features | None:
        """The processed `images` of a request, checked against the placeholders in
        `token_ids` (`checked_images`)."""
        return await checked_images(self.vision, self.model_path, token_ids, images)

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        """Marks requests aborted; they return with finish reason "abort" and their tokens so far."""
        return self._inflight.abort(request_ids, all_requests)

    def _stop(self, requests: list[_Pending]) -> None:
        """Flags the requests; the decoding loop ends each at its next step, with the
        tokens it has."""
        for pending in requests:
            pending.aborted.set()
        self._aborts += 1

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
        # Not interruptible: the running batch takes no newcomers, so it drains and the
        # update comes next (a batch that kept taking joiners would hold it back forever).
        self._draining = True
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._worker, self._apply_weights, tensors, version
            )
        finally:
            self._draining = False

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

    async def score(
        self,
        sequences: list[tuple[list[int], int]],
        top_k: int,
        images: list[list[ImageRef]] | None = None,
    ) -> tuple[list[Scores], int]:
        """Each (token ids, start) sequence's logprobs from `start` on (and top-k), with
        the version that scored them: one forward per `max_batch_size` sequences, on the
        worker thread, so between two generation batches and never across a weight swap.
        `images`: each sequence's, for the placeholders it holds (a vision-language model)."""
        if self._closed:
            raise RuntimeError("the engine is shutting down")
        validate_scoring(sequences, top_k, self.vocab_size, self.max_context)
        images = images or [[] for _ in sequences]
        if len(images) != len(sequences):
            raise RequestError(f"{len(images)} image lists for {len(sequences)} sequences")
        features = [
            await self.image_features(ids, shown)
            for (ids, _), shown in zip(sequences, images, strict=True)
        ]
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self._score, sequences, top_k, features
        )

    # ------------------------------------------------------------ worker side

    @torch.inference_mode()
    def _score(
        self,
        sequences: list[tuple[list[int], int]],
        top_k: int,
        features: list[Features | None],
    ) -> tuple[list[Scores], int]:
        version = self._version
        out: list[Scores] = []
        for first in range(0, len(sequences), self.max_batch_size):
            chunk = sequences[first : first + self.max_batch_size]
            longest = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), longest), self.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), longest), dtype=torch.long)
            for row, (tokens, _) in enumerate(chunk):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                attention[row, : len(tokens)] = 1
            shown = [f for f in features[first : first + self.max_batch_size] if f is not None]
            ids, attention = ids.to(self.device), attention.to(self.device)
            inputs = {}
            if shown:
                assert self.vision is not None
                inputs = self.vision.forward_inputs(self.model, ids, attention, shown)
            logits = self.model(input_ids=ids, attention_mask=attention, **inputs).logits
            if self.vision is not None:
                logits = suppress(logits, self.vision.suppressed)
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for row, (tokens, start) in enumerate(chunk):
                # Position t - 1 predicts token t.
                rows = logprobs[row, start - 1 : len(tokens) - 1]
                targets = torch.tensor(tokens[start:])
                chosen = rows.gather(1, targets[:, None])[:, 0]
                top_ids: list[list[int]] = []
                top_values: list[list[float]] = []
                if top_k:
                    values, indices = rows.topk(top_k, dim=-1)
                    top_ids, top_values = indices.tolist(), values.tolist()
                out.append(Scores(chosen.tolist(), top_ids, top_values))
        return out, version

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
            while not self._intake:
                self._arrived.clear()
                await self._arrived.wait()
            # Each arrival keeps the batch open for another `batch_wait_seconds`, up to
            # `batch_max_wait_seconds` from the first.
            cap = loop.time() + self.batch_max_wait_seconds
            while len(self._intake) < self.max_batch_size and loop.time() < cap:
                self._arrived.clear()
                gap = min(self.batch_wait_seconds, cap - loop.time())
                try:
                    await asyncio.wait_for(self._arrived.wait(), gap)
                except TimeoutError:
                    break
            batch = [
                self._intake.popleft() for _ in range(min(len(self._intake), self.max_batch_size))
            ]
            try:
                await loop.run_in_executor(self._worker, self._generate_batch, batch)
            except Exception:  # every row was answered by the worker, failed or not
                log.exception("generation failed", extra={"batch_size": len(batch)})
            finally:
                self.running = 0

    def _deliver(self, pending: _Pending, result: Generation | BaseException) -> None:
        """Answers one request from the worker thread, as soon as its row is done."""

        def settle() -> None:
            if pending.future.done():
                return
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            self._loop.call_soon_threadsafe(settle)

    def _generate_batch(self, batch: list[_Pending]) -> None:
        """Generates `batch` and the requests that join it, answering each when it ends."""
        with self._update_lock:
            self._generating = True
        rows: list[_Row] = []
        try:
            self._decode(batch, rows)
        except Exception as error:  # a model failure fails these requests, not the engine
            for row in rows:
                if row.finish is None:
                    self._deliver(row.pending, error)
            raise
        finally:
            with self._update_lock:
                self._generating = False
            self._take_update()  # one that came after the last step: applied before the next batch

    @torch.inference_mode()
    def _decode(self, batch: list[_Pending], rows: list[_Row]) -> None:
        """The decoding loop of one batch. Requests join it between two steps on its KV
        cache (`_merge`; continuous batching), and rows are laid out again left-padded with
        a fresh cache when new weights arrive (interruptible generation) or the cache
        cannot be edited; finished rows answer at once and stay in the batch, ignored,
        until half of it is done or the next change of rows drops them.

        A step does no Python work per row: sampling, stop tokens and length limits are
        tensor operations over the batch (`_Layout`), and a row's tokens become Python
        lists only when it finishes or the batch is laid out again."""
        rows.extend(_Row.start(pending) for pending in batch)
        version = self._version
        interrupted = False
        layout: _Layout | None = None
        aborts_seen = -1
        step_ids = step_positions = attention = cache = None
        while layout is None or layout.live:
            relayout = layout is None
            if self._pending_update is not None and self._take_update():
                self.interrupted_batches += not interrupted
                version, relayout, interrupted = self._version, True, True
            live = len(rows) if layout is None else layout.live
            room = self.max_batch_size - live
            joining = []
            while room > 0 and self._intake and not self._draining:
                try:
                    joining.append(_Row.start(self._intake.popleft()))
                except IndexError:  # taken by the batch loop meanwhile
                    break
                room -= 1
            if joining:
                self.joined_rows += len(joining)
            if layout is not None and not relayout and (joining or 2 * layout.live < len(rows)):
                # Newcomers, or half the rows done: the cache is kept (its finished rows
                # dropped, the newcomers' prompts computed alone and put beside it) where
                # its layout allows; otherwise everything is laid out again below.
                merged = self._merge(
                    layout, rows, joining, cache, step_ids, attention, step_positions
                )
                if merged is None:
                    relayout = True
                else:
                    cache, step_ids, attention, step_positions = merged
                    self.cache_merges += 1
                    layout = _Layout(rows, version, self._generator)
                    aborts_seen = -1
            elif joining:
                relayout = True
            if relayout:
                if layout is not None:
                    layout.flush()
                rows[:] = [row for row in rows if row.finish is None] + joining
                layout = _Layout(rows, version, self._generator)
                self.layouts += 1
                step_ids, attention = self._left_padded([row.sequence for row in rows])
                step_positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
                cache = None
                aborts_seen = -1
            self.running = layout.live
            if cache is None:  # a prompt's forward: its images, and their positions
                inputs, step_positions = self._prompt_inputs(
                    rows, step_ids, attention, step_positions
                )
            else:
                inputs = {"position_ids": step_positions.to(self.device)}
            out = self.model(
                input_ids=step_ids.to(self.device),
                attention_mask=attention.to(self.device),
                past_key_values=cache,
                use_cache=True,
                **inputs,
                **self._last_logits_only,
            )
            cache = out.past_key_values
            if self._aborts != aborts_seen:  # an abort since the last look: which rows
                aborts_seen = self._aborts
                for index in layout.aborted():
                    self._finish(rows[index], layout.version)
            tokens, chosen = layout.sampler.sample(self._next_logits(out.logits[:, -1, :]))
            for index in layout.advance(tokens, chosen):
                self._finish(rows[index], layout.version)
            step_ids = tokens[:, None]
            attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            step_positions = step_positions[:, -1:] + 1

    def _merge(
        self,
        layout: _Layout,
        rows: list[_Row],
        joining: list[_Row],
        cache: object,
        step_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[object, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Keeps the KV cache across a change of rows: the finished ones leave it, and the
        newcomers' prompts (all but their last token, which is their first step's input)
        are computed alone and put beside it, both left-padded to one width. Sets `rows`
        to the rows now in the batch; returns the next step's cache and inputs, or None
        for a cache this cannot edit (not a plain `DynamicCache`: sliding windows and
        other layouts are laid out again instead)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        if type(cache) is not DynamicCache or any(
            type(layer) is not DynamicLayer or layer.keys is None for layer in cache.layers
        ):
            return None
        keep = layout.active.nonzero().squeeze(1)
        layout.flush()
        rows[:] = [rows[index] for index in keep.tolist()]
        if len(keep) < attention.shape[0]:
            cache.batch_select_indices(keep)
            step_ids, attention, positions = step_ids[keep], attention[keep], positions[keep]
        if not joining:
            return cache, step_ids, attention, positions
        # Widths are those of the cache: the input token's column of `attention` is last.
        held = attention.shape[1] - 1
        prefixes = [row.sequence[:-1] for row in joining]
        longest = max(len(prefix) for prefix in prefixes)
        width = max(held, longest)
        following = torch.tensor([[len(prefix)] for prefix in prefixes], dtype=positions.dtype)
        if longest:
            ids, mask = self._left_padded(prefixes)
            inputs, prefix_positions = self._prompt_inputs(
                joining, ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)
            )
            following = prefix_positions[:, -1:] + 1
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                use_cache=True,
                **inputs,
                **self._last_logits_only,
            )
            added = out.past_key_values
            if type(added) is not DynamicCache or len(added.layers) != len(cache.layers):
                return None
            parts = [(layer.keys, layer.values) for layer in added.layers]
        else:
            mask = torch.zeros((len(joining), 0), dtype=torch.long)
            parts = [(None, None)] * len(cache.layers)
        for layer, (keys, values) in zip(cache.layers, parts, strict=True):
            if keys is None:
                shape = (len(joining), *layer.keys.shape[1:2], 0, layer.keys.shape[3])
                keys = values = layer.keys.new_zeros(shape)
            layer.keys = torch.cat([_pad_left(layer.keys, width, 2), _pad_left(keys, width, 2)])
            layer.values = torch.cat(
                [_pad_left(layer.values, width, 2), _pad_left(values, width, 2)]
            )
        one = torch.ones((len(joining), 1), dtype=torch.long)
        attention = torch.cat(
            [
                torch.cat([_pad_left(attention[:, :-1], width, 1), attention[:, -1:]], dim=1),
                torch.cat([_pad_left(mask, width, 1), one], dim=1),
            ]
        )
        step_ids = torch.cat([step_ids, torch.tensor([[row.sequence[-1]] for row in joining])])
        positions = torch.cat([positions, following])
        rows.extend(joining)
        return cache, step_ids, attention, positions

    def _next_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The last position's logits on the CPU, a vision model's placeholders suppressed."""
        if self.vision is not None:
            logits = suppress(logits, self.vision.suppressed)
        return logits.cpu()

    def _prompt_inputs(
        self, rows: list[_Row], ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor
    ) -> tuple[dict, torch.Tensor]:
        """The model inputs of a forward over `rows`' left-padded prompts `ids`: the text
        `positions`, or for rows with images their pixels and the model's
        three-dimensional positions; and each token's position as the next decoding step
        goes on from (the last column: where the next token's position follows)."""
        features = [row.pending.features for row in rows if row.pending.features is not None]
        if not features:
            return {"position_ids": positions.to(self.device)}, positions
        assert self.vision is not None
        vision = self.vision.forward_inputs(
            self.model, ids.to(self.device), attention.to(self.device), features
        )
        # A prompt ends in text: its last position is the same in all three dimensions.
        return vision, vision["position_ids"].amax(dim=0).cpu()

    def _finish(self, row: _Row, version: int) -> None:
        self.generated_tokens += len(row.tokens)
        self._deliver(row.pending, row.result(version))

    def _left_padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(sequence) for sequence in sequences)
        ids = torch.full((len(sequences), longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, longest - len(sequence) :] = torch.tensor(sequence)
            attention[row, longest - len(sequence) :] = 1
        return ids, attention


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` zero-padded at the front of `dim` to `width`."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class _Layout:
    """The live rows of one batch layout as tensors: which still generate, how many tokens
    each has, its limit and stop tokens, and the tokens sampled since the layout began
    (one column per step). Rows take their tokens as lists when they finish (`advance`,
    `aborted`) or when the batch is laid out again (`flush`)."""

    def __init__(
        self, rows: list[_Row], version: int, generator: torch.Generator | None = None
    ) -> None:
        self.rows = rows
        self.version = version
        self.live = len(rows)
        specs = [row.pending.spec for row in rows]
        self.sampler = SamplingBatch(specs, [row.generator for row in rows], generator)
        self.active = torch.ones(len(rows), dtype=torch.bool)
        self.count = torch.tensor([len(row.tokens) for row in rows])
        self.limit = torch.tensor([spec.max_new_tokens for spec in specs])
        widest = max(1, *(len(spec.stop_token_ids) for spec in specs))
        self.stops = torch.full((len(rows), widest), -1, dtype=torch.long)
        for index, spec in enumerate(specs):
            if spec.stop_token_ids:
                self.stops[index, : len(spec.stop_token_ids)] = torch.tensor(
                    sorted(spec.stop_token_ids)
                )
        room = int((self.limit - self.count).max()) if rows else 0
        self.tokens = torch.zeros((len(rows), room), dtype=torch.long)
        self.logprobs = torch.zeros((len(rows), room), dtype=torch.float32)
        self.steps = 0
        self.flushed = False

    def advance(self, tokens: torch.Tensor, chosen: torch.Tensor) -> list[int]:
        """Records one step's tokens; returns the rows it finished (their reason set)."""
        self.tokens[:, self.steps] = tokens
        self.logprobs[:, self.steps] = chosen
        self.steps += 1
        stopped = (tokens[:, None] == self.stops).any(dim=1)
        self.count += self.active
        done = self.active & (stopped | (self.count >= self.limit))
        if not bool(done.any()):
            return []
        self.active &= ~done
        finished = done.nonzero().squeeze(1).tolist()
        for index in finished:
            self._take(index, self.steps, "stop" if bool(stopped[index]) else "length")
        return finished

    def aborted(self) -> list[int]:
        """Live rows whose request was aborted: they end with the tokens they have."""
        found = [
            index
            for index in self.active.nonzero().squeeze(1).tolist()
            if self.rows[index].pending.aborted.is_set()
        ]
        for index in found:
            self.active[index] = False
            self._take(index, self.steps, "abort")
        return found

    def flush(self) -> None:
        """Hands the live rows their tokens so far, before the batch is laid out again
        (once: the layout is done with after it)."""
        if self.flushed:
            return
        self.flushed = True
        for index in self.active.nonzero().squeeze(1).tolist():
            self._take(index, self.steps, None)

    def _take(self, index: int, steps: int, finish: str | None) -> None:
        row = self.rows[index]
        row.tokens.extend(self.tokens[index, :steps].tolist())
        row.logprobs.extend(self.logprobs[index, :steps].tolist())
        row.versions.extend([self.version] * steps)
        row.finish = finish
        if finish is not None:
            self.live -= 1


@dataclass
class _Row:
    """One request inside a running batch."""

    pending: _Pending
    generator: torch.Generator | None
    started: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None

    @classmethod
    def start(cls, pending: _Pending) -> _Row:
        generator = None
        if pending.spec.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(pending.spec.seed)
        return cls(pending, generator, time.monotonic())

    @property
    def sequence(self) -> list[int]:
        return self.pending.prompt_ids + self.tokens

    def result(self, version: int) -> Generation:
        return Generation(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            policy_versions=self.versions,
            finish_reason=self.finish or "length",
            policy_version=version,
            queue_seconds=self.started - self.pending.enqueued,
            generate_seconds=time.monotonic() - self.started,
        )
