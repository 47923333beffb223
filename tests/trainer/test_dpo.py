"""`rollwire dpo`: preference tuning against the model as it starts, on pairs of a right
and a wrong answer; its model then scores higher on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runs import EXAMPLES, chain_sum_files, jsonl, rollwire


def greedy_reward(tmp_path: Path, run: Path, model: Path) -> float:
    rollwire(tmp_path, "eval", f"run.output_dir={run}", extra=["--checkpoint", str(model)])
    return json.loads((run / "evals" / model.name / "eval.json").read_text())["greedy_reward"]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_sft_then_dpo_examples_raise_preference_and_reward(tmp_path) -> None:
    """examples/sft.yaml on examples/chain_sum_data.py's chat file (answers off by one
    60% of the time), then examples/dpo.yaml on its pairs preferring the right answer:
    held-out preference for the right answer and held-out greedy reward both rise."""
    data = chain_sum_files(tmp_path / "data", off_by_one=0.6)
    sft = tmp_path / "sft"
    rollwire(
        tmp_path,
        "sft",
        f"run.output_dir={sft}",
        f"sft.data={data / 'sft.jsonl'}",
        extra=["-c", str(EXAMPLES / "sft.yaml")],
    )
    before = greedy_reward(tmp_path, sft, sft / "final")
    dpo = tmp_path / "dpo"
    out = rollwire(
        tmp_path,
        "dpo",
        f"run.output_dir={dpo}",
        f"trainer.model_path={sft / 'final'}",
        f"dpo.data={data / 'pairs.jsonl'}",
        extra=["-c", str(EXAMPLES / "dpo.yaml")],
    )
    assert "reference logprobs of" in out
    evals = [row for row in jsonl(dpo / "metrics" / "dpo.jsonl") if "eval_loss" in row]
    prefers = [row["eval_prefers_chosen"] for row in evals]
    print(f"held-out: prefers the right answer {prefers}")
    assert evals[0]["eval_reward_margin"] == pytest.approx(0.0, abs=1e-5)  # its own reference
    assert prefers[-1] >= prefers[0] + 0.12, prefers
    assert evals[-1]["eval_chosen_logprob"] > evals[0]["eval_chosen_logprob"]
    after = greedy_reward(tmp_path, dpo, dpo / "final")
    print(f"held-out greedy reward {before:.3f} -> {after:.3f}")
    assert after >= before + 0.07, (before, after)


def _dpo_run(tmp_path: Path, name: str, model: Path, data: Path, *sets: str) -> list[dict]:
    run = tmp_path / name
    rollwire(
        tmp_path,
        "dpo",
        f"run.output_dir={run}",
        f"trainer.model_path={model}",
        f"dpo.data={data}",
        "dpo.max_steps=4",
        "dpo.batch_size=6",
        "dpo.eval_every=2",
        "trainer.batching.micro_batch_size=4",
        "trainer.optimizer.learning_rate=0.003",
        *sets,
    )
    return jsonl(run / "metrics" / "dpo.jsonl")


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_dpo_on_two_fsdp2_ranks_equals_one_process_and_ipo_simpo_lora_run(
    tmp_path, tiny_model_path
) -> None:
    pairs = chain_sum_files(tmp_path / "data", rows=200) / "pairs.jsonl"
    local = _dpo_run(tmp_path, "local", tiny_model_path, pairs)
    sharded = _dpo_run(
        tmp_path, "fsdp2", tiny_model_path, pairs, "trainer.backend=fsdp2", "trainer.world_size=2"
    )
    assert [row["step"] for row in sharded] == [0, 1, 2, 3, 4]
    for ours, theirs in zip(sharded, local, strict=True):
        for key, value in theirs.items():
            if key not in ("time", "step_seconds"):
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (ours["step"], key)
    for name, extra in (
        ("ipo", ["dpo.loss=ipo"]),
        ("simpo", ["dpo.loss=simpo", "dpo.beta=2.0"]),
        ("lora", ["trainer.lora={rank: 4, alpha: 8}"]),
    ):
        metrics = _dpo_run(tmp_path, name, tiny_model_path, pairs, *extra)
        trained = [row for row in metrics if "loss" in row]
        assert len(trained) == 4 and all(row["grad_norm"] > 0 for row in trained), name
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "final")
