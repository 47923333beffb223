"""Generation from an OpenAI-compatible completions server someone already runs.

The rollout-server sends each request to `{base_url}/completions` with the prompt
as token ids and streams the answer back; the server must return the sampled
tokens as ids with their logprobs (vLLM: `return_tokens_as_token_ids`, which this
engine asks for). For the logprobs to be those of the distribution the tokens were
drawn from (what the trainer recomputes), start vLLM with `--logprobs-mode
processed_logprobs`; `rollwire mismatch` shows whether they agree.

Weights: with `update_weights: none` (the default) the server keeps its own and
an update from the trainer is refused (UNIMPLEMENTED). With `update_weights: vllm`
the server must be a vLLM server started with `VLLM_SERVER_DEV_MODE=1` and
`--worker-extension-cls rollwire.rollout.server.vllm_worker.WeightLoader`: an update
pauses it (`/pause`, aborting requests in flight when interruptible, else
waiting for them), sends the tensors as one safetensors blob through
`/collective_rpc`, resets the prefix cache and resumes. Requests the pause
aborted are sent again with their prompt plus the tokens they had, so, as with
the in-process engines, the tokens so far are kept and each is tagged with the
version that produced it. The blob travels base64 in JSON (4/3 of the weights'
bytes): fine for small models and a CPU server; large models on GPUs want the
in-process engines.

HTTP is the standard library's, one blocking connection per request on a thread
pool sized to `max_concurrency`; aborting a request closes its connection (the
server then aborts it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rollwire.rollout.server.engine import (
    Generation,
    RequestError,
    Scores,
    ScoreUnsupported,
    UpdateUnsupported,
    checkpoint_parameter_specs,
    model_limits,
    validate_request,
)
from rollwire.rollout.server.requests import InFlight
from rollwire.rollout.server.sampling import SamplingSpec

log = logging.getLogger(__name__)
RESEED_STRIDE = 1_000_003


class ServerError(RuntimeError):
    """The completions server failed or could not be reached."""


@dataclass
class _Stream:
    """What one request has received so far (filled by its thread)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    connection: http.client.HTTPConnection | None = None
    aborted: threading.Event = field(default_factory=threading.Event)


class OpenAIEngine:
    """An OpenAI-compatible completions server behind the rollout-server's engine interface."""

    name = "openai"

    def __init__(
        self,
        base_url: str | None,
        model_path: str | Path | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout_seconds: float = 300.0,
        update_weights: Literal["none", "vllm"] = "none",
        max_concurrency: int = 256,
        interruptible: bool = True,
        dtype: str = "float32",
        seed: int | None = None,
    ) -> None:
        """`seed` (rollout_server.seed): a request that brings no seed of its own is sent
        one made from it and the request id, so a run's unseeded samples repeat too."""
        if not base_url:
            raise ValueError("engine 'openai' needs base_url, e.g. http://127.0.0.1:8000/v1")
        if update_weights not in ("none", "vllm"):
            raise ValueError(f"update_weights must be 'none' or 'vllm', not {update_weights!r}")
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url {base_url!r} is not an http(s) URL")
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._api_prefix = parts.path  # e.g. /v1
        self._root_prefix = parts.path.removesuffix("/v1")  # vLLM's admin routes live here
        self.base_url = base_url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_seconds = timeout_seconds
        self.seed = seed
        self.update_mode = update_weights
        self.interruptible = interruptible
        listing = self._request_json("GET", f"{self._api_prefix}/models", None, timeout=30)
        served = [entry["id"] for entry in listing.get("data", [])]
        if model is None and not served:
            raise ServerError(f"{self.base_url}/models lists no model")
        if model is not None and served and model not in served:
            raise ValueError(f"the server serves {served}, not {model!r}")
        self.model = model or served[0]
        entry = next(e for e in listing["data"] if e["id"] == self.model) if served else {}
        local = Path(model_path) if model_path else Path(str(entry.get("root") or self.model))
        self.model_path = local
        self._specs: dict[str, Any] = {}
        self.vocab_size = 1 << 31
        self.max_context = int(entry.get("max_model_len") or 1 << 30)
        if (local / "config.json").exists():
            self.vocab_size = model_limits(local)[0]
            self._specs = checkpoint_parameter_specs(local, dtype)
        elif update_weights != "none":
            raise ValueError(
                "update_weights needs the model's config to check weight streams: set "
                "rollout_server.model_path to a local copy of the served model"
            )
        self._version = 0
        self.generated_tokens = 0
        self.interrupted_requests = 0
        self._running = 0
        self._inflight: InFlight[_Stream] = InFlight(self._stop)
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="http")
        self._updated = asyncio.Event()
        self._updated.set()
        self._update_lock: asyncio.Lock | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return 0  # the server queues; it does not say how much

    @property
    def threads(self) -> int:
        return 0

    def set_threads(self, threads: int) -> str | None:
        return "the openai engine computes in another server; its threads are that server's"

    def parameter_specs(self) -> dict[str, Any]:
        return self._specs

    async def start(self) -> None:
        self._update_lock = asyncio.Lock()

    async def close(self) -> None:
        self._closed = True
        self.abort(all_requests=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ requests

    async def generate(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec
    ) -> Generation:
        if self._closed:
            raise RuntimeError("the engine is shutting down")
        validate_request(prompt_ids, spec, self.vocab_size, self.max_context)
        with self._inflight.hold(request_id, _Stream) as stream:
            started = time.monotonic()
            loop = asyncio.get_running_loop()
            self._running += 1
            try:
                attempt = 0
                while True:
                    await self._updated.wait()  # a request never starts mid-update
                    body = self._body(
                        prompt_ids + stream.tokens, spec, len(stream.tokens), attempt, request_id
                    )
                    await loop.run_in_executor(self._threads, self._stream_completion, body, stream)
                    if stream.finish != "abort" or stream.aborted.is_set():
                        break
                    # Aborted by the server: an interrupting update paused it. Go on after it.
                    self.interrupted_requests += attempt == 0
                    attempt += 1
                    await self._updated.wait()
                    if len(stream.tokens) >= spec.max_new_tokens:
                        stream.finish = "length"
                        break
            finally:
                self._running -= 1
        self.generated_tokens += len(stream.tokens)
        return Generation(
            token_ids=stream.tokens,
            logprobs=stream.logprobs,
            policy_versions=stream.versions,
            finish_reason=stream.finish or "length",
            policy_version=self._version,
            queue_seconds=0.0,
            generate_seconds=time.monotonic() - started,
        )

    def _body(
        self, prompt: list[int], spec: SamplingSpec, have: int, attempt: int, request_id: str
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": spec.max_new_tokens - have,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "logprobs": 0,
            "stream": True,
            # vLLM's extensions: ids instead of text, the request's own stop tokens only.
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
            "stop_token_ids": sorted(spec.stop_token_ids),
            "skip_special_tokens": False,
        }
        if spec.top_k:
            body["top_k"] = spec.top_k
        seed = spec.seed
        if seed is None and self.seed is not None:
            digest = hashlib.blake2b(f"{self.seed}/{request_id}".encode(), digest_size=8)
            seed = int.from_bytes(digest.digest(), "big") >> 4
        if seed is not None:
            body["seed"] = seed + attempt * RESEED_STRIDE
        return body

    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int:
        """Aborts requests; they return with finish reason "abort" and their tokens so far."""
        return self._inflight.abort(request_ids, all_requests)

    def _stop(self, streams: list[_Stream]) -> None:
        """Flags the streams and closes their connections (the server then aborts them)."""
        for stream in streams:
            stream.aborted.set()
            connection = stream.connection
            if connection is not None and connection.sock is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)

    async def score(
        self, sequences: list[tuple[list[int], int]], top_k: int
    ) -> tuple[list[Scores], int]:
        raise ScoreUnsupported(
            "an OpenAI-compatible completions server does not score given token ids; serve "
            "the teacher with rollout_server.engine hf or vllm"
        )

    # ------------------------------------------------------------ weights

    async def update_weights(self, tensors: dict[str, Any], version: int) -> float:
        if self.update_mode == "none":
            raise UpdateUnsupported(
                f"the completions server at {self.base_url} keeps its own weights "
                "(rollout_server.engine_args.update_weights is 'none'); for a vLLM server "
                "started with rollwire's worker extension set it to 'vllm'"
            )
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the served version {self._version}"
            )
        assert self._update_lock is not None, "start() first"
        async with self._update_lock:
            started = time.perf_counter()
            payload = await asyncio.to_thread(_safetensors_b64, tensors)
            mode = "abort" if self.interruptible else "wait"
            self._updated.clear()
            try:
                await self._admin("POST", f"/pause?mode={mode}", None)
                try:
                    await self._admin(
                        "POST",
                        "/collective_rpc",
                        {"method": "rollwire_load_weights", "args": [payload]},
                    )
                    await self._admin("POST", "/reset_prefix_cache", None)
                    self._version = version
                finally:
                    await self._admin("POST", "/resume", None)
            finally:
                self._updated.set()
            return time.perf_counter() - started

    async def _admin(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        return await asyncio.to_thread(
            self._request_json, method, f"{self._root_prefix}{path}", body, self.timeout_seconds
        )

    # ------------------------------------------------------------ HTTP (worker threads)

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        kind = (
            http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        )
        return kind(self._host, self._port, timeout=timeout)

    def _request_json(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float
    ) -> Any:
        connection = self._connect(timeout)
        try:
            connection.request(
                method, path, body=None if body is None else json.dumps(body), headers=self._headers
            )
            response = connection.getresponse()
            data = response.read()
        except OSError as error:
            raise ServerError(f"{method} {self._where(path)} failed: {error}") from error
        finally:
            connection.close()
        if response.status >= 400:
            raise ServerError(
                f"{method} {self._where(path)} answered {response.status}: {data[:500]!r}"
            )
        return json.loads(data) if data else None

    def _where(self, path: str) -> str:
        return f"{self._scheme}://{self._host}:{self._port}{path}"

    def _stream_completion(self, body: dict[str, Any], stream: _Stream) -> None:
        """Posts one streamed completion and appends what arrives to `stream`."""
        stream.finish = None
        connection = stream.connection = self._connect(self.timeout_seconds)
        path = f"{self._api_prefix}/completions"
        try:
            if stream.aborted.is_set():
                stream.finish = "abort"
                return
            connection.request("POST", path, body=json.dumps(body), headers=self._headers)
            response = connection.getresponse()
            if response.status >= 400:
                detail = response.read()[:1000].decode(errors="replace")
                if response.status in (400, 422):
                    raise RequestError(f"the completions server refused the request: {detail}")
                raise ServerError(f"POST {self._where(path)} answered {response.status}: {detail}")
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                self._take_chunk(json.loads(data), stream)
        except (OSError, http.client.HTTPException) as error:
            if not stream.aborted.is_set():
                raise ServerError(f"POST {self._where(path)} failed: {error}") from error
        finally:
            stream.connection = None
            connection.close()
        if stream.aborted.is_set():
            stream.finish = "abort"

    def _take_chunk(self, chunk: dict[str, Any], stream: _Stream) -> None:
        if "error" in chunk:
            raise ServerError(f"the completions server failed mid-stream: {chunk['error']}")
        choice = chunk["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        if len(values) != len(tokens):
            raise ServerError("the server sent tokens without their logprobs")
        for token, value in zip(tokens, values, strict=True):
            if not str(token).startswith("token_id:"):
                raise ServerError(
                    f"the server returned the token {token!r} as text: it must honour "
                    "return_tokens_as_token_ids (vLLM does)"
                )
            stream.tokens.append(int(str(token)[9:]))
            stream.logprobs.append(float(value))
            stream.versions.append(self._version)
        reason = choice.get("finish_reason")
        if reason is not None:
            stream.finish = reason if reason in ("stop", "length", "abort") else "length"


def _safetensors_b64(tensors: dict[str, Any]) -> str:
    from safetensors.torch import save

    return base64.b64encode(
        save({name: tensor.contiguous() for name, tensor in tensors.items()})
    ).decode("ascii")
