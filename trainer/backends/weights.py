"""Weights in buckets, and a Hugging Face model folder written from a stream of them.

Shared by the trainer backends (`base.py`); torch and safetensors, nothing
distributed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch


def buckets(
    items: Sequence[tuple[str, torch.nn.Parameter]], bucket_bytes: int, size_of: Any = None
) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of named parameters of at most `bucket_bytes` of full size each
    (a larger parameter is a group alone). `size_of(param)` gives the full size in bytes."""
    size_of = size_of or (lambda p: p.numel() * p.element_size())
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    total = 0
    for name, param in items:
        size = size_of(param)
        if bucket and total + size > bucket_bytes:
            yield bucket
            bucket, total = [], 0
        bucket.append((name, param))
        total += size
    if bucket:
        yield bucket


def write_pretrained(
    folder: Path,
    config: Any,
    weights: Iterator[tuple[str, torch.Tensor]],
    shard_bytes: int,
    stem: str = "model",
    save_config: Any = None,
) -> None:
    """Streams `weights` into safetensors files of at most about `shard_bytes` (one
    `{stem}.safetensors`, or numbered shards and their index) with the config
    (`save_config(config, folder)`, by default `config.save_pretrained(folder)`): with
    what the model's family saves beside it (`ModelFamily.save_extras`), a folder
    `from_pretrained` loads. Not collective."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[list[str]] = []
    size, total = 0, 0

    def flush() -> None:
        names = list(shards[-1])
        save_file(shards[-1], str(folder / f"part-{len(written):05d}"), metadata={"format": "pt"})
        written.append(names)
        shards[-1] = {}

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    if shards[-1] or not written:
        flush()
    if len(written) == 1:
        os.replace(folder / "part-00000", folder / f"{stem}.safetensors")
    else:
        weight_map: dict[str, str] = {}
        count = len(written)
        for index, names in enumerate(written):
            file = f"{stem}-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(folder / f"part-{index:05d}", folder / file)
            weight_map.update(dict.fromkeys(names, file))
        index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        (folder / f"{stem}.safetensors.index.json").write_text(index_text, encoding="utf-8")
    if save_config is None:
        config.save_pretrained(folder)
    else:
        save_config(config, folder)
