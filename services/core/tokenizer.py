"""Which tokenizer a model folder has, as one string two services can compare."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_digest(model_path: str | Path | None) -> str:
    """sha256 of the tokenizer at `model_path`: its vocabulary (token -> id) and special
    tokens; "" without a local model folder or one without a tokenizer. Equal digests: the same ids mean the
    same text, so one model's logprobs of another's tokens make sense."""
    import hashlib
    import json

    if model_path is None or not (Path(model_path) / "config.json").exists():
        return ""
    if not any((Path(model_path) / name).exists() for name in TOKENIZER_FILES):
        return ""  # a model without a tokenizer (a diffusion model's folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    identity = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(token) for token in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()
