"""What every generation engine behind the rollout-server offers, and the checks they share.

An engine generates continuations of token-id prompts with the logprob of every
token under the distribution it was drawn from and the policy version that
produced it, aborts requests, and swaps in new weights with a newer version.
`HFEngine` (transformers), `VLLMEngine`, `SGLangEngine` and `OpenAIEngine`
implement it; the rollout-server speaks only to this interface.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollwire.rollout.server.sampling import SamplingSpec

if TYPE_CHECKING:
    import torch


class RequestError(ValueError):
    """A request the engine cannot serve as given (empty prompt, bad ids, too long)."""


class ContextTooLong(RequestError):
    """Prompt plus max_new_tokens exceeds the model's context."""


class UpdateUnsupported(RuntimeError):
    """This engine cannot take weights from the trainer (e.g. an external server)."""


class ScoreUnsupported(RuntimeError):
    """This engine cannot score given tokens (`ScoreTokens`)."""


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
class Scores:
    """One sequence's scores (`Engine.score`): the logprob of each token from `start` on,
    and for each of those positions the `top_k` most likely tokens and their logprobs."""

    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


MAX_SCORE_TOP_K = 64
"""The most alternatives per position `ScoreTokens` returns."""


class Engine(Protocol):
    """The rollout-server's view of a generation engine."""

    name: str
    model_path: Path
    generated_tokens: int

    @property
    def version(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def generate(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec
    ) -> Generation: ...
    def abort(self, request_ids: list[str] = (), all_requests: bool = False) -> int: ...
    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float: ...
    async def score(
        self, sequences: list[tuple[list[int], int]], top_k: int
    ) -> tuple[list[Scores], int]: ...
    @property
    def threads(self) -> int:
        """The CPU threads it computes with; 0 when not a CPU engine of this process."""
        ...

    def set_threads(self, threads: int) -> str | None:
        """Computes with `threads` CPU threads from the next batch on: None, or why it
        cannot change them at run time."""
        ...


def validate_request(
    prompt_ids: list[int], spec: SamplingSpec, vocab_size: int, max_context: int
) -> None:
    """Raises RequestError for a request no engine can serve."""
    if not prompt_ids:
        raise RequestError("prompt_token_ids is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if spec.max_new_tokens < 1:
        raise RequestError("max_new_tokens must be at least 1")
    if not (math.isfinite(spec.temperature) and math.isfinite(spec.top_p)):
        # NaN compares false with everything: without this it would pass as greedy.
        raise RequestError(
            f"temperature ({spec.temperature}) and top_p ({spec.top_p}) must be finite numbers"
        )
    if spec.temperature < 0 or not 0 <= spec.top_p <= 1 or spec.top_k < 0:
        raise RequestError("temperature must be >= 0, top_p in [0, 1] and top_k >= 0")
    if len(prompt_ids) + spec.max_new_tokens > max_context:
        raise ContextTooLong(
            f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {spec.max_new_tokens} "
            f"exceeds the model's context of {max_context}"
        )


async def checked_images(
    vision: Any,
    model_path: Path,
    token_ids: list[int],
    images: list,
    prepare: Callable | None = None,
) -> Any:
    """A request's images checked (off the event loop) against the placeholders in
    `token_ids` by the served folder's `VisionSide` (`vision`; None for a text model):
    their processed features, or `prepare(images)` of them when given (what an engine
    passes on instead); None without images. RequestError for a bad image, or for images
    sent to a model that takes none."""
    from rollwire.services.core.images import ImageError

    if vision is None:
        if images:
            raise RequestError(f"{model_path} is not a vision-language model: it takes no images")
        return None

    def checked() -> Any:
        features = vision.check(token_ids, list(images))
        return features if prepare is None or features is None else prepare(list(images))

    try:
        return await asyncio.to_thread(checked)
    except ImageError as error:
        raise RequestError(str(error)) from None


def validate_scoring(
    sequences: list[tuple[list[int], int]], top_k: int, vocab_size: int, max_context: int
) -> None:
    """Raises RequestError for a `ScoreTokens` request no engine can serve: (token ids,
    start) sequences, each scored from `start` on."""
    if not sequences:
        raise RequestError("no sequences to score")
    if not 0 <= top_k <= MAX_SCORE_TOP_K:
        raise RequestError(f"top_k must lie in [0, {MAX_SCORE_TOP_K}]")
    for index, (ids, start) in enumerate(sequences):
        if not 1 <= start < len(ids):
            raise RequestError(
                f"sequence {index}: start {start} outside [1, {len(ids)}) (the tokens before "
                "start are the context, at least one; at least one token is scored)"
            )
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RequestError(f"sequence {index}: token ids must lie in [0, {vocab_size})")
        if len(ids) > max_context:
            raise ContextTooLong(
                f"sequence {index} of {len(ids)} tokens exceeds the model's context of "
                f"{max_context}"
            )


def model_folder(model_path: str | Path) -> Path:
    """`model_path` as a Path; FileNotFoundError unless it holds a Hugging Face model."""
    path = Path(model_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no Hugging Face model at {path}: expected a folder with config.json and weights"
        )
    return path


def model_limits(path: Path) -> tuple[int, int]:
    """(vocabulary size, context length) of the model at `path`, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()  # a VLM's: its language part
    return int(config.vocab_size), int(getattr(config, "max_position_embeddings", 1 << 30))


def checkpoint_parameter_specs(
    model_path: Path, dtype: str
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the parameters of the Hugging Face model at `model_path`, as
    the trainer names them, built on the meta device (no weights read). Engines that keep
    weights in their own layout (vLLM fuses q/k/v) check weight streams against these."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rollwire.services.core.vision import is_vision_model

    config = AutoConfig.from_pretrained(model_path)
    kind = AutoModelForImageTextToText if is_vision_model(model_path) else AutoModelForCausalLM
    with torch.device("meta"):
        model = kind.from_config(config)
    served = getattr(torch, dtype)
    return {name: (tuple(p.shape), served) for name, p in model.named_parameters()}
