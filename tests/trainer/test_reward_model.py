"""`rollwire reward-model`: a Bradley-Terry reward model from a causal LM, trained on
preference rows, saved as the folder the reward-server's `reward_model` domain loads, which
then scores as the trainer did."""

from __future__ import annotations

import json
import random

import pytest

from rollwire.services.core.config import RewardModelConfig, load_config
from tests.helpers.runs import jsonl


def rows(count: int, seed: int) -> list[dict]:
    """Prompts `a + b =`; the chosen response is a sentence of `good`, the rejected one of
    `bad` (a preference a tiny model learns in a few dozen steps)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = f"{rng.randint(0, 99)} + {rng.randint(0, 99)} ="
        words = rng.randint(1, 3)
        out.append({"prompt": prompt, "chosen": " good" * words, "rejected": " bad" * words})
    return out


def write(path, items) -> str:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reward_model_learns_the_preference_and_the_reward_server_scores_as_it_trained(
    tmp_path, tiny_model_path, capsys
) -> None:
    from rollwire.reward.reward_model import RewardModel
    from rollwire.reward.scorers import ScoreInput
    from rollwire.services.app.run import run_offline

    held = rows(24, seed=1)
    config = load_config(
        None,
        [
            f"trainer.model_path={tiny_model_path}",
            f"run.output_dir={tmp_path / 'rm'}",
            f"reward_model.data={write(tmp_path / 'train.jsonl', rows(256, seed=0))}",
            f"reward_model.eval_data={write(tmp_path / 'held.jsonl', held)}",
            "reward_model.chat=false",
            "reward_model.batch_size=16",
            "reward_model.epochs=4",
            "reward_model.max_steps=40",
            "reward_model.eval_every=20",
            "trainer.optimizer.learning_rate=3e-3",
        ],
        environ={},
    )
    assert run_offline(config, "reward-model") == 0
    assert "held-out preference accuracy" in capsys.readouterr().out
    evals = [
        row
        for row in jsonl(tmp_path / "rm" / "metrics" / "reward-model.jsonl")
        if "eval_loss" in row
    ]
    # A zeroed head: every score 0, every margin 0 (a tie is not a right answer).
    assert evals[0]["eval_accuracy"] == 0.0 and evals[0]["eval_loss"] == pytest.approx(
        0.6931, abs=1e-3
    )
    assert evals[-1]["eval_accuracy"] == 1.0 and evals[-1]["eval_loss"] < 0.2, evals
    final = tmp_path / "rm" / "final"
    served = RewardModel(RewardModelConfig(model_path=final, chat=False, batch_size=8))
    scores = served.score_batch(
        [
            ScoreInput(response=row[key], reference="", prompt=row["prompt"])
            for row in held
            for key in ("chosen", "rejected")
        ]
    )
    margins = [scores[i].reward - scores[i + 1].reward for i in range(0, len(scores), 2)]
    assert min(margins) > 0, margins
