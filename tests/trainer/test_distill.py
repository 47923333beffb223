"""`rollwire distill generate`: a teacher's scored answers as rows, and a student trained
on them with `rollwire sft`."""

from __future__ import annotations

import pytest

from rollwire.services.core.config import RunConfig
from rollwire.services.core.datasets import load_tasks
from tests.helpers.runs import chain_sum_files, fine_tune, jsonl, rollwire


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_student_learns_from_the_teachers_kept_answers(tmp_path) -> None:
    """A teacher fine-tuned on the right answers answers 3,000 training prompts four
    times; the answers the reward-server scores 1 become an SFT file, and the untrained
    tiny model trained on it scores on held-out prompts."""
    data = chain_sum_files(tmp_path / "data")
    teacher = fine_tune(tmp_path, tmp_path / "teacher", data / "sft.jsonl").parent
    out = rollwire(
        tmp_path,
        "distill",
        f"run.output_dir={tmp_path / 'distill'}",
        f"trainer.model_path={teacher / 'final'}",
        "distill.prompts=3000",
        "distill.samples=4",
        "distill.min_reward=1",
        "distill.top_k=8",
        extra=["generate"],
    )
    assert "12000 answers to 3000 prompts" in out
    kept = jsonl(tmp_path / "distill" / "distill.jsonl")
    # Token-level data too: each answer token's teacher top-8, its own token among them
    # (it was sampled from that distribution, so it is usually the likeliest).
    first = kept[0]
    assert len(first["top_ids"]) == len(first["completion_ids"]) and len(first["top_ids"][0]) == 8
    assert len(first["tokenizer"]) == 64  # the teacher's tokenizer digest, checked by sft
    pairs = [
        (token, top)
        for row in kept
        for token, top in zip(row["completion_ids"], row["top_ids"], strict=True)
    ]
    share = sum(token in top for token, top in pairs) / len(pairs)
    assert share > 0.95, share
    # Measured: mean reward 0.257 of the 12,000 answers, 3,063 kept.
    assert len(kept) > 1000 and all(row["reward"] >= 1 for row in kept)
    # Training prompts only: none is a question of the held-out evaluation set.
    config = RunConfig()
    template = config.orchestrator.prompt_template
    held_out = {task.prompt(template) for task in load_tasks(config.orchestrator.eval_dataset)}
    assert not {row["prompt"] for row in kept} & held_out
    distilled = tmp_path / "distill" / "distill.jsonl"
    report = fine_tune(tmp_path, tmp_path / "student", distilled, evaluate=True)
    # The untrained student scores 0, the teacher 0.325. While the teacher's samples were
    # unseeded the student's score varied with them (of eight runs on 2026-12-02 four fell
    # under 0.1), and the bar was lowered to 0.05. Seeded (orchestrator.sampling_seed, each
    # prompt's place, run.seed), five runs on 2026-12-04 all read 0.13, and 0.15
    # token-level: the bar is back at 0.1.
    print(f"student on the kept answers: held-out greedy reward {report['greedy_reward']}")
    assert report["greedy_reward"] >= 0.1, report
    # Token-level: the same rows, the loss a forward KL to the teacher's top-8.
    report = fine_tune(
        tmp_path, tmp_path / "token_level", distilled, "sft.loss=forward_kl", evaluate=True
    )
    print(f"token-level student: held-out greedy reward {report['greedy_reward']}")
    assert report["greedy_reward"] >= 0.1, report


def test_distill_generate_refuses_an_env_dataset(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "agentic.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollwire.services.app.cli",
            "distill",
            "generate",
            "-c",
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ROLLWIRE_CACHE_DIR": str(tmp_path)},
    )
    assert done.returncode == 1 and "env datasets are not supported" in done.stdout
