"""A tiny causal LM and character-level tokenizer, built offline in Hugging Face format.

The default run, the tests and the benchmarks need a model without any download.
`ensure_tiny_model(folder)` builds one on first use (a Llama architecture with
tied embeddings and a tokenizer whose vocabulary is printable ASCII plus a few
special tokens). Llama rather than Qwen2: transformers forces its own Qwen2
tokenizer pipeline onto any qwen2 model folder, which would split our
character vocabulary wrongly; for Llama it honours the saved tokenizer. and reuses it afterwards; anything that loads Hugging Face
models (`AutoModelForCausalLM.from_pretrained`) can load it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollwire.services.core.files import cache_dir, staged_directory

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
ANSWER_TAGS = ("<answer>", "</answer>")
BUILD_MARKER = "rollwire_tiny.json"


def default_model_path() -> Path:
    """Where the built-in tiny model lives: $ROLLWIRE_CACHE_DIR or ~/.cache/rollwire, then tiny-model."""
    return cache_dir() / "tiny-model"


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; defaults give about 0.4M parameters."""

    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    """Width of one attention head. 32 rather than hidden_size / heads (24): vLLM's CPU
    attention takes head sizes from 32 up, so one tiny model serves every engine."""
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 256
    seed: int = 0
    vision: int = 0
    """1: a vision-language model of the Qwen2-VL shape instead (`build_tiny_vlm`): a
    one-block vision tower and the same text sizes, heads of hidden_size / heads."""
    image_size: int = 56
    """A vision model's images are resized to image_size x image_size (a multiple of 28),
    (image_size / 28)^2 image tokens each."""


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers in service logs."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def build_tokenizer():
    """A character-level fast tokenizer: printable ASCII, newline, answer tags, specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = [chr(code) for code in range(32, 127)] + ["\n"]
    vocab = {token: index for index, token in enumerate([PAD, EOS, UNK, *characters])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(tag, normalized=False) for tag in ANSWER_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK
    )


def build_tiny_model(
    folder: str | Path, spec: TinySpec = TinySpec(), keep_existing: bool = False
) -> Path:
    """Writes a freshly initialised model and its tokenizer to `folder` (replaced if present;
    with `keep_existing`, one that another process finished meanwhile is kept)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if spec.vision:
        return build_tiny_vlm(folder, spec, keep_existing)
    quiet_transformers()
    folder = Path(folder)
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 8) * 8  # round up: friendlier matmul shapes
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _save_built(folder, spec, keep_existing, lambda: LlamaForCausalLM(config), tokenizer)


def tiny_model_of(overrides: dict[str, int]) -> Path:
    """The tiny model of run.tiny_model's shape `overrides`, built once into the cache
    (a folder per shape; every shape has the same tokenizer)."""
    import hashlib

    spec = TinySpec(**overrides)
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    return ensure_tiny_model(cache_dir() / f"tiny-{digest}", spec, keep_existing=True)


def ensure_tiny_model(
    folder: str | Path, spec: TinySpec = TinySpec(), keep_existing: bool = False
) -> Path:
    """The tiny model in `folder`, built only if it is missing or was built with another spec
    (`keep_existing`: the folder is keyed by the spec, and may be built by another process)."""
    folder = Path(folder)
    marker = folder / BUILD_MARKER
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return folder
    return build_tiny_model(folder, spec, keep_existing)


VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def build_tiny_vlm(folder: str | Path, spec: TinySpec, keep_existing: bool = False) -> Path:
    """A freshly initialised Qwen2-VL-shaped model (`spec.vision`), the character tokenizer
    with the three vision tokens added, and a Pillow image processor that makes every image
    `spec.image_size` pixels square (the processor that also wants torchvision is not
    needed: the tokenizer and the image processor are saved apart)."""
    from tokenizers import AddedToken
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    if spec.image_size % 28:
        raise ValueError(
            f"run.tiny_model.image_size must be a multiple of 28, not {spec.image_size}"
        )
    quiet_transformers()
    folder = Path(folder)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS])
    start, pad, end = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    head = spec.hidden_size // spec.num_attention_heads
    quarter = head // 2 // 4  # M-RoPE splits a head's rotary pairs over time, height, width
    sections = [
        quarter,
        (head // 2 - quarter) // 2,
        head // 2 - quarter - (head // 2 - quarter) // 2,
    ]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": -(-len(tokenizer) // 8) * 8,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": sections,
                "rope_theta": 10000.0,
            },
            "tie_word_embeddings": spec.tie_word_embeddings,
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": spec.hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=pad,
        video_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    pixels = spec.image_size * spec.image_size
    processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return _save_built(
        folder,
        spec,
        keep_existing,
        lambda: Qwen2VLForConditionalGeneration(config),
        tokenizer,
        processor,
    )


def _save_built(folder: Path, spec: TinySpec, keep_existing: bool, make: Any, *beside: Any) -> Path:
    """`make()` initialised from `spec.seed` (torch's global generator left as it was),
    saved whole into `folder` with `beside` (a tokenizer, a processor) and the build
    marker; with `keep_existing`, a folder another process finished meanwhile is kept."""
    import torch

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        model = make()
    finally:
        torch.random.set_rng_state(generator_state)
    keep = BUILD_MARKER if keep_existing else None
    with staged_directory(folder, keep_if_present=keep) as staging:
        model.save_pretrained(staging)
        for part in beside:
            part.save_pretrained(staging)
        (staging / BUILD_MARKER).write_text(json.dumps(asdict(spec)))
    return folder
