"""Generation with SGLang: `sglang.Engine` in this process, driven through its asyncio API.

SGLang's asyncio side binds to the event loop that first calls it, so the engine runs it on
a loop and thread of its own; requests, aborts and updates may come from any loop. Prompts
go in as token ids; a request is an `async_generate` call with `return_logprob`, an abort
SGLang's `abort_request` on that call's rid.

Logprobs: SGLang returns a token's log-probability after the temperature (greedy: of the
raw logits), as the trainer recomputes it (unless `SGLANG_RETURN_ORIGINAL_LOGPROB` is set:
untempered). It does not renormalise over what top-k/top-p keep: with those, the logprob is
lower than the trainer's by the log of the kept mass. The engine passes it on and warns.

Seeds: SGLang honours `sampling_seed` only with `enable_deterministic_inference`, which the
engine turns on (`engine_args` can turn it off, at the price of seeds). SGLang then draws
from seed and position and gives unseeded requests one fixed seed; the engine seeds those.

Stop tokens: `ignore_eos` also switches off `stop_token_ids`, so it is set only without stop
tokens. With them, an EOS that is not one of the request's ends a submission, and the
engine submits prompt plus tokens again for the rest.

Weight updates interrupt (`interruptible=True`): submissions are held back, those in flight
aborted (returning their tokens so far), the weights loaded (`update_weights_from_tensor`,
or NCCL broadcasts), the prefix cache flushed, and each interrupted request submitted again
with prompt plus tokens for what it may still generate; every token carries the version
that produced it. With `interruptible=False` an update waits for submissions to finish.
SGLang's own pause modes are not used (their signature changed within 0.5.x). `close` ends
with `Engine.shutdown`, which kills every child process of this process, not only SGLang's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollwire.rollout.server.engine import (
    Generation,
    RequestError,
    Scores,
    ScoreUnsupported,
    checkpoint_parameter_specs,
    model_folder,
    model_limits,
    validate_request,
)
from rollwire.rollout.server.requests import InFlight
from rollwire.rollout.server.sampling import SamplingSpec

log = logging.getLogger(__name__)
NCCL_GROUP = "rollwire-weights"
SEED_RANGE = 1 << 31  # some 0.5.x releases keep per-request seeds in an int32 tensor


@contextlib.contextmanager
def keep_event_loop_policy() -> Iterator[None]:
    """SGLang's modules install uvloop's event-loop policy process-wide on import; this puts
    the caller's back, so the gRPC server's and the tests' loops stay as they were."""
    policy = asyncio.get_event_loop_policy()
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)


def import_sglang() -> Any:
    """SGLang's `Engine` class, or a clear error saying what it needs."""
    try:
        with keep_event_loop_policy():
            from sglang.srt.entrypoints.engine import Engine
    except ImportError as error:
        raise RuntimeError(
            "rollout_server.engine 'sglang' needs SGLang, which runs only on a CUDA GPU (its "
            f"wheels are CUDA builds): on a GPU machine `pip install 'rollwire[sglang]'` ({error})"
        ) from error
    return Engine


@dataclass
class _Track:
    """One request, across the SGLang submissions that interruptions split it into."""

    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    seed: int
    enqueued: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rid: str | None = None  # SGLang's id of the submission in flight
    interrupted: bool = False  # that submission was aborted for a weight update
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # used on the engine's loop

    def result(self, finish: str, version: int, started: float) -> Generation:
        return Generation(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            policy_versions=self.versions,
            finish_reason=finish,
            policy_version=version,
            queue_seconds=started - self.enqueued,
            generate_seconds=time.monotonic() - started,
        )


class SGLangEngine:
    """SGLang behind the rollout-server's engine interface."""

    name = "sglang"

    def __init__(
        self,
        model_path: str | Path,
        max_batch_size: int = 32,
        dtype: str = "float32",
        interruptible: bool = True,
        initial_version: int = 0,
        seed: int = 0,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        path = model_folder(model_path)
        engine_class = import_sglang()
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            log.warning("SGLANG_RETURN_ORIGINAL_LOGPROB is set: logprobs will be untempered")
        self.model_path = path
        self.vocab_size, self.max_context = model_limits(path)
        self._specs = checkpoint_parameter_specs(path, dtype)
        arguments: dict[str, Any] = {
            "model_path": str(path),
            "skip_tokenizer_init": True,  # prompts and outputs are token ids
            "dtype": dtype,
            "max_running_requests": max_batch_size,
            "random_seed": seed,
            **(engine_args or {}),
        }
        from sglang.srt.server_args import ServerArgs

        if hasattr(ServerArgs, "enable_deterministic_inference"):  # not in early 0.5.x
            arguments.setdefault("enable_deterministic_inference", True)  # for per-request seeds
        started = time.perf_counter()
        with keep_event_loop_policy():
            self.engine = engine_class(**arguments)
        log.info(
            "SGLang engine ready",
            extra={"model": str(path), "seconds": round(time.perf_counter() - started, 2)},
        )
        server_args = self.engine.server_args
        self.seeded = bool(getattr(server_args, "enable_deterministic_inference", False))
        self.tp_size = int(getattr(server_args, "tp_size", 1))
        self.interruptible = interruptible
        self._version = initial_version
        self.generated_tokens = 0
        self.interrupted_requests = 0
        self.interrupted_updates = 0
        self._rng = random.Random(seed)
        self._warned_truncation = False
        self._closed = False
        self._inflight: InFlight[_Track] = InFlight(self._stop)
        self._running: dict[str, _Track] = {}  # by SGLang rid; the engine's loop only
        self._tasks: set[asyncio.Task] = set()
        self._gate = asyncio.Event()  # cleared while an update holds submissions back
        self._idle = asyncio.Event()  # set while nothing is submitted
        self._gate.set()
        self._idle.set()
        self._update_lock = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang", daemon=True)
        self._thread.start()

    async def _on_loop(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coroutine` on the engine's loop and waits for it from the caller's."""
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the engine is shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    # ------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return max(len(self._inflight) - len(self._running), 0)

    @property
    def threads(self) -> int:
        return 0

    def set_threads(self, threads: int) -> str | None:
        return "SGLang sets its threads when it starts; they cannot change at run time"

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint names -> (shape, dtype): what a weight stream from the trainer carries."""
        return self._specs

    async def start(self) -> None:
        """Nothing to do: the engine's loop runs from construction."""

    async def close(self) -> None:
        """Aborts what is in flight, stops the engine's loop and shuts SGLang down."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                await self._on_loop(self._drain())
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join, 30.0)
            if not self._thread.is_alive():
                self._loop.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.engine.shutdown)

    async def _drain(self) -> None:
        """Aborts every request, gives them ten seconds to come back, cancels the rest."""
        self._abort_tracks(self._inflight.values())
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=10.0)
            for task in pending:
                task.cancel()

    # ------------------------------------------------------------ requests

    async def generate(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec
    ) -> Generation:
        if self._closed:
            raise RuntimeError("the engine is shutting down (closed)")
        validate_request(prompt_ids, spec, self.vocab_size, self.max_context)
        # The seed is drawn once the id is known to be free: a refused duplicate leaves the
        # sequence of unseeded requests' seeds as it was.
        new_track = functools.partial(self._track, request_id, prompt_ids, spec)
        with self._inflight.hold(request_id, new_track) as track:
            truncated = 0 < spec.top_k < self.vocab_size or 0 < spec.top_p < 1
            if truncated and spec.temperature > 0 and not self._warned_truncation:
                self._warned_truncation = True
                log.warning(
                    "SGLang does not renormalise logprobs over what top-k/top-p keep: they stay "
                    "those of the tempered distribution over the whole vocabulary"
                )
            try:
                return await self._on_loop(self._run(track))
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                if self._closed:
                    raise RuntimeError("the engine is shutting down") from None
                raise

    def _track(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec) -> _Track:
        """A new request's track, with its seed: its own, or the next of the engine's."""
        seed = spec.seed if spec.seed is not None else self._rng.randrange(SEED_RANGE)
        return _Track(request_id, list(prompt_ids), spec, seed % SEED_RANGE)

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        """Aborts requests; they return with finish reason "abort" and their tokens so far."""
        return self._inflight.abort(request_ids, all_requests)

    def _stop(self, tracks: list[_Track]) -> None:
        """Aborts the tracks on the engine's loop, where their SGLang submissions run."""
        if tracks and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_tracks, tracks)

    # ------------------------------------------------------------ the engine's loop

    async def _run(self, track: _Track) -> Generation:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            started, outcome = time.monotonic(), None
            while outcome is None:
                if not await self._wait_for_gate(track):
                    outcome = "abort"
                else:
                    outcome = await self._submit(track)
            self.generated_tokens += len(track.tokens)
            return track.result(outcome, self._version, started)
        finally:
            self._tasks.discard(task)

    async def _wait_for_gate(self, track: _Track) -> bool:
        """Waits while an update holds submissions back; False once the request is aborted."""
        while not self._gate.is_set() and not track.aborted.is_set():
            waits = {asyncio.ensure_future(e.wait()) for e in (self._gate, track.aborted)}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
        return not track.aborted.is_set()

    def _sampling_params(self, track: _Track) -> dict[str, Any]:
        spec = track.spec
        params: dict[str, Any] = {
            "max_new_tokens": spec.max_new_tokens - len(track.tokens),
            "temperature": spec.temperature,  # 0: greedy
            "top_p": spec.top_p if 0 < spec.top_p < 1 else 1.0,
            "top_k": spec.top_k if spec.top_k > 0 else -1,  # -1: the whole vocabulary
            # Explicit, so nothing comes from the model's generation_config.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": not spec.stop_token_ids,  # it would switch off stop_token_ids too
            "no_stop_trim": True,  # the matched stop token stays in output_ids
        }
        if spec.stop_token_ids:
            params["stop_token_ids"] = sorted(spec.stop_token_ids)
        if self.seeded:
            params["sampling_seed"] = track.seed
        return params

    async def _submit(self, track: _Track) -> str | None:
        """One SGLang submission; the request's finish reason, or None to submit the rest
        again (after an interruption, or past the model's EOS)."""
        rid = uuid.uuid4().hex  # one length: SGLang aborts every rid starting with the one named
        version = self._version  # updates wait for submissions: all its tokens share it
        track.rid, track.interrupted = rid, False
        self._running[rid] = track
        self._idle.clear()
        try:
            output = await self.engine.async_generate(
                input_ids=track.prompt_ids + track.tokens,
                sampling_params=self._sampling_params(track),
                return_logprob=True,
                logprob_start_len=-1,  # logprobs of the output tokens only
                rid=rid,
            )
        except asyncio.CancelledError:
            self._abort_rid(rid)
            raise
        except ValueError as error:  # how SGLang refuses a request
            if not (track.aborted.is_set() or track.interrupted):
                raise RequestError(f"SGLang refused the request: {error}") from error
            output = {"meta_info": {"finish_reason": {"type": "abort"}}}
        finally:
            del self._running[rid]
            track.rid = None
            if not self._running:
                self._idle.set()
        meta = output.get("meta_info") or {}
        tokens = [int(token) for token in output.get("output_ids") or []]
        entries = meta.get("output_token_logprobs") or []  # (logprob, token id, text) each
        kind = (meta.get("finish_reason") or {}).get("type")
        if len(entries) != len(tokens):
            if kind != "abort":
                raise RuntimeError(f"SGLang gave {len(tokens)} tokens, {len(entries)} logprobs")
            tokens, entries = tokens[: len(entries)], entries[: len(tokens)]  # keep whole pairs
        track.tokens += tokens
        track.logprobs += [float(entry[0]) for entry in entries]
        track.versions += [version] * len(tokens)
        if track.aborted.is_set():
            return "abort"
        if track.tokens and track.tokens[-1] in track.spec.stop_token_ids:
            return "stop"
        if len(track.tokens) >= track.spec.max_new_tokens:
            return "length"
        if (kind == "abort" and track.interrupted) or (kind == "stop" and tokens):
            return None  # interrupted by an update, or stopped by an EOS the request lacks
        return "abort" if kind == "abort" else "length"

    def _abort_tracks(self, tracks: list[_Track]) -> None:
        for track in tracks:
            track.aborted.set()
            if track.rid is not None:
                self._abort_rid(track.rid)

    def _abort_rid(self, rid: str) -> None:
        """Aborts one submission. SGLang drops an abort for a rid it has not registered yet
        (still being tokenized), so then this tries again shortly."""
        if rid not in self._running:
            return
        manager = self.engine.tokenizer_manager
        known = getattr(manager, "rid_to_state", None)
        if known is not None and rid not in known:
            self._loop.call_later(0.005, self._abort_rid, rid)
        else:
            manager.abort_request(rid)

    # ------------------------------------------------------------ weights

    async def score(
        self, sequences: list[tuple[list[int], int]], top_k: int
    ) -> tuple[list[Scores], int]:
        raise ScoreUnsupported(
            "the sglang engine does not score given token ids yet; serve the teacher with "
            "rollout_server.engine hf or vllm"
        )

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """Loads checkpoint-named tensors with SGLang's `update_weights_from_tensor` (which
        maps names and tied weights as its checkpoint loader does); returns seconds loading."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        self._check_newer(version)
        named = list(tensors.items())
        # One payload per tensor-parallel rank; CPU tensors travel through shared memory.
        payloads = [MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)]
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=None, flush_cache=False
        )
        manager = self.engine.tokenizer_manager
        load = lambda: manager.update_weights_from_tensor(request, None)  # noqa: E731
        return await self._on_loop(self._update(version, load))

    async def init_nccl_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = NCCL_GROUP,
    ) -> None:
        """Joins a process group for weight broadcasts (SGLang's `init_weights_update_group`)
        while the trainer creates it too, as rank 0; the engine's ranks start at rank_offset."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        request = InitWeightsUpdateGroupReqInput(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend="nccl",
        )
        manager = self.engine.tokenizer_manager
        reply = await self._on_loop(manager.init_weights_update_group(request, None))
        if not reply[0]:
            raise RuntimeError(f"SGLang could not join weight group {group_name}: {reply[1]}")

    async def update_weights_from_distributed(
        self,
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
        version: int,
        group_name: str = NCCL_GROUP,
    ) -> float:
        """New weights over NCCL: while this waits, the trainer broadcasts from its rank 0 each
        tensor in `specs`, in order, with that shape and dtype. Returns seconds loading."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        self._check_newer(version)
        request = UpdateWeightsFromDistributedReqInput(
            names=list(specs),
            dtypes=[str(dtype).removeprefix("torch.") for _, dtype in specs.values()],
            shapes=[list(shape) for shape, _ in specs.values()],
            group_name=group_name,
            flush_cache=False,
        )
        manager = self.engine.tokenizer_manager
        load = lambda: manager.update_weights_from_distributed(request, None)  # noqa: E731
        return await self._on_loop(self._update(version, load))

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )

    async def _update(self, version: int, load: Callable[[], Awaitable[Any]]) -> float:
        """Holds submissions back, empties SGLang (aborting or waiting), loads, flushes the
        prefix cache, and lets requests go on."""
        async with self._update_lock:
            self._check_newer(version)  # a concurrent update may have got there first
            self._gate.clear()
            manager = self.engine.tokenizer_manager
            interrupted = list(self._running.values()) if self.interruptible else []
            try:
                for track in interrupted:
                    track.interrupted = True
                    self._abort_rid(track.rid)
                await self._idle.wait()
                started = time.perf_counter()
                reply = await load()  # (success, message)
                if not reply[0]:
                    raise RuntimeError(f"SGLang did not take the weights: {reply[1]}")
                # The prefix cache holds KV of the old weights. SGLang refuses to flush while a
                # finished request is still leaving its scheduler: ask again for a while.
                for _ in range(200):
                    if getattr(await manager.flush_cache(), "success", True):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError("SGLang kept refusing to flush its prefix cache")
                self._version = version
                seconds = time.perf_counter() - started
            finally:
                self._gate.set()
            self.interrupted_updates += bool(interrupted)
            self.interrupted_requests += len(interrupted)
            return seconds
