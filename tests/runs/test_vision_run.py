"""A vision-language RL run through every process: images go from the dataset through the
orchestrator, the rollout-server and the buffer to the trainer, which redoes the engine's
forward on them exactly."""

from __future__ import annotations

import pytest

from tests.helpers.runs import REPO, assert_no_process_left, jsonl, rollwire, rollwire_train


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_short_vision_run_through_every_process(tmp_path) -> None:
    run_dir, result = rollwire_train(
        tmp_path,
        "warmup.steps=30",
        "rl.max_steps=3",
        "rl.groups_per_step=8",
        "orchestrator.eval_every=3",
        config=REPO / "examples" / "vlm_rlvr.yaml",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [row["step"] for row in steps] == [1, 2, 3]
    # One image a sequence, each one there in the trainer's batch.
    assert all(row["sequences"] == row["images"] == 64 for row in steps), steps
    # The trainer's logprobs of the sampled tokens, pixels included, are the engine's.
    checked = [row for row in steps if row.get("mismatch_tokens", 0) > 0]
    assert checked and all(row["mismatch_abs_max"] <= 1e-5 for row in checked), checked
    evals = jsonl(run_dir / "metrics" / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, 3]
    assert all(e["tasks"] == 297 for e in evals)  # the held-out images, none trained on
    assert_no_process_left(run_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_on_policy_distillation_between_two_vision_models_sends_the_teacher_the_images(
    tmp_path,
) -> None:
    """The teacher-server scores each sampled answer with its image (ScoreTokens carries
    it): with the student's own weights as the teacher, the first step's divergence is 0
    to float precision, where a teacher scoring the placeholders without their pixels
    would disagree."""
    from rollwire.services.core.tiny import tiny_model_of

    model = tiny_model_of({"vision": 1})
    run_dir, result = rollwire_train(
        tmp_path,
        f"trainer.model_path={model}",
        f"distill.teacher_model_path={model}",
        "trainer.algorithm.advantage={type: on_policy_distill}",
        "rl.max_steps=2",
        "rl.groups_per_step=4",
        "orchestrator.eval_dataset=null",
        config=REPO / "examples" / "vlm_rlvr.yaml",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [row["step"] for row in steps] == [1, 2]
    assert abs(steps[0]["teacher_kl"]) <= 1e-5, steps[0]
    assert steps[0]["images"] == 32
    assert "rollout_scored_tokens" in (run_dir / "logs" / "teacher-server.log").read_text()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_an_agentic_run_with_pictures_for_observations(tmp_path) -> None:
    """digit_lock's pictures go from the env-server through the orchestrator's turns and
    the rollout-server to the trainer, which redoes the forward with every one of them."""
    run_dir, result = rollwire_train(
        tmp_path,
        "warmup.steps=30",
        "rl.max_steps=2",
        "rl.groups_per_step=4",
        "orchestrator.eval_every=2",
        "orchestrator.eval_dataset.size=16",
        config=REPO / "examples" / "vlm_agentic.yaml",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [row["step"] for row in steps] == [1, 2]
    # One picture per observation the policy acted on: one to three an episode.
    assert all(32 <= row["images"] <= 3 * 32 and row["sequences"] == 32 for row in steps), steps
    checked = [row for row in steps if row.get("mismatch_tokens", 0) > 0]
    assert checked and all(row["mismatch_abs_max"] <= 1e-5 for row in checked), checked
    evals = jsonl(run_dir / "metrics" / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, 2]
    assert all(e["tasks"] == 16 for e in evals)
    assert_no_process_left(run_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_token_level_distillation_data_from_image_prompts_keeps_the_images(tmp_path) -> None:
    """`rollwire distill generate` on digit prompts writes each row's image beside the
    teacher's top-k (scored with the pixels); `rollwire sft` with a KL loss puts it back
    where the prompt ids hold its pad tokens: a student that is the teacher starts at a
    divergence of 0 (its forward sees the pixels the teacher's did)."""
    from rollwire.services.core.tiny import tiny_model_of
    from rollwire.services.core.vision import VisionSide

    model = tiny_model_of({"vision": 1})
    config = ["-c", str(REPO / "examples" / "vlm_rlvr.yaml")]
    rollwire(
        tmp_path,
        "distill",
        f"run.output_dir={tmp_path / 'distill'}",
        f"trainer.model_path={model}",
        "distill.prompts=12",
        "distill.samples=2",
        "distill.top_k=4",
        extra=["generate", *config],
    )
    rows = jsonl(tmp_path / "distill" / "distill.jsonl")
    assert len(rows) == 24
    side = VisionSide(model)
    for row in rows:
        (image,) = row["images"]
        assert image["format"] == "png" and image["data"]
        assert row["prompt_ids"].count(side.image_token) == 4  # the tiny model's four
        assert len(row["top_ids"]) == len(row["completion_ids"])
    out = rollwire(
        tmp_path,
        "sft",
        f"run.output_dir={tmp_path / 'student'}",
        f"trainer.model_path={model}",
        f"sft.data={tmp_path / 'distill' / 'distill.jsonl'}",
        "sft.loss=forward_kl",
        "sft.epochs=1",
        "sft.batch_size=8",
        extra=config,
    )
    steps = [row for row in jsonl(tmp_path / "student" / "metrics" / "sft.jsonl") if "loss" in row]
    assert steps and abs(steps[0]["loss"]) <= 1e-5, (steps[0], out[-2000:])
