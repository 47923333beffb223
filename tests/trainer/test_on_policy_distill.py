"""On-policy distillation: the teacher's scores of the student's samples, the tokenizer
check, the config's checks, and a run in which the student moves toward the teacher."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.rollout.orchestrator.teacher import Teacher, TokenizerMismatch
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import RunConfig
from tests.conftest import TEST_SPEC
from tests.helpers.runs import chain_sum_files, fine_tune, rollwire
from tests.helpers.servers import serve_model
from tests.helpers.trajectories import group


def distill_config(teachers: list[str]) -> RunConfig:
    return RunConfig.model_validate(
        {
            "trainer": {"advantage": {"type": "on_policy_distill"}},
            "endpoints": {"teacher_servers": teachers},
            "client": {"connect_timeout_seconds": 10},
        }
    )


@pytest.mark.integration
async def test_the_teacher_scores_each_generated_token_and_nothing_else(
    start_service, tiny_model_path
) -> None:
    student, _ = await serve_model(start_service, tiny_model_path)
    teacher_address, engine = await serve_model(start_service, tiny_model_path)
    teacher = Teacher(distill_config([teacher_address]))
    async with open_channel(student) as channel:
        await teacher.connect([rollout_pb2_grpc.RolloutServiceStub(channel)])
    trajectories = group()
    # A multi-turn shape: an observation token (mask 0) between two generated ones.
    trajectories[0].loss_mask[-2] = 0
    await teacher.score(trajectories)
    for trajectory in trajectories:
        ids, mask = trajectory.token_ids.tolist(), trajectory.loss_mask
        start = int(np.flatnonzero(mask)[0])
        (expected,), _ = await engine.score([(ids, start)], 0)
        want = np.zeros(len(ids), np.float32)
        want[start:] = expected.logprobs
        np.testing.assert_allclose(trajectory.teacher_logprobs, want * mask, atol=1e-6)
    assert trajectories[0].teacher_logprobs[-2] == 0.0
    assert teacher.scored_tokens == sum(int(t.loss_mask.sum()) for t in trajectories)
    await teacher.close()


@pytest.mark.integration
async def test_a_teacher_with_another_tokenizer_is_refused(
    start_service, tiny_model_path, tmp_path
) -> None:
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_path, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    student, _ = await serve_model(start_service, tiny_model_path)
    teacher_address, _ = await serve_model(start_service, other)
    teacher = Teacher(distill_config([teacher_address]))
    async with open_channel(student) as channel:
        with pytest.raises(TokenizerMismatch, match="does not share the student's tokenizer"):
            await teacher.connect([rollout_pb2_grpc.RolloutServiceStub(channel)])
    await teacher.close()


def test_on_policy_distillation_needs_a_teacher_and_temperature_one() -> None:
    with pytest.raises(ValueError, match="needs a teacher: set distill.teacher_model_path"):
        RunConfig.model_validate({"trainer": {"advantage": {"type": "on_policy_distill"}}})
    with pytest.raises(ValueError, match="set rl.temperature to 1"):
        RunConfig.model_validate(
            {
                "trainer": {"advantage": {"type": "on_policy_distill"}},
                "distill": {"teacher_model_path": "/models/teacher"},
                "rl": {"temperature": 0.7},
            }
        )
    with pytest.raises(ValueError, match="filter_uniform_groups drops groups"):
        RunConfig.model_validate(
            {
                "trainer": {"advantage": {"type": "on_policy_distill"}},
                "distill": {"teacher_model_path": "/models/teacher"},
                "orchestrator": {"filter_uniform_groups": True},
            }
        )
    with pytest.raises(ValueError, match="on_policy_distill"):
        RunConfig.model_validate({"trainer": {"advantage": {"type": "on_policy_distil"}}})


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_student_moves_toward_the_teacher(tmp_path) -> None:
    """A teacher fine-tuned on right answers; the default student (warmed up on answers
    60% off by one) trained by the teacher's per-token scores alone, no reward."""
    data = chain_sum_files(tmp_path / "data")
    teacher = fine_tune(tmp_path, tmp_path / "teacher", data / "sft.jsonl", "sft.epochs=16")
    run = tmp_path / "run"
    rollwire(
        tmp_path,
        "train",
        f"run.output_dir={run}",
        "trainer.algorithm.advantage={type: on_policy_distill}",
        f"distill.teacher_model_path={teacher}",
        "rl.max_steps=40",
        "orchestrator.eval_every=10",
        timeout=500,
    )
    evals = [json.loads(line) for line in (run / "metrics" / "eval.jsonl").read_text().splitlines()]
    curve = [(e["policy_version"], e["eval_reward"]) for e in evals]
    print(f"held-out greedy reward by version: {curve}")
    steps = [
        json.loads(line) for line in (run / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    kl = [row["teacher_kl"] for row in steps]
    print(f"teacher_kl first five {np.mean(kl[:5]):.3f}, last five {np.mean(kl[-5:]):.3f}")
    # The student's divergence from the teacher on its own samples falls, and its
    # held-out reward rises toward the teacher's. The teacher trains 16 epochs: at 8 it
    # scored about 0.325, barely above a student warmed up to 0.265, and the rise it could
    # give (0.03 to 0.065 in three runs) was no test. Five runs on 2026-12-04 (async, two
    # cores shared with the rest of the suite's load): best rises 0.095, 0.115, 0.09,
    # 0.115, 0.115 from 0.265; teacher_kl 0.45 over the first five steps, 0.25 the last.
    assert np.mean(kl[-5:]) < np.mean(kl[:5]) - 0.05, kl
    assert max(reward for _, reward in curve[2:]) >= curve[0][1] + 0.05, curve


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_on_policy_distillation_on_two_fsdp2_ranks(tmp_path, tiny_model_path) -> None:
    """The teacher's token advantages on a sharded trainer: a teacher of the same shape and
    tokenizer but other weights, three steps on two fsdp2 ranks (gloo)."""
    from rollwire.services.core.tiny import ensure_tiny_model

    teacher = ensure_tiny_model(tmp_path / "teacher", dataclasses.replace(TEST_SPEC, seed=1))
    run = tmp_path / "run"
    rollwire(
        tmp_path,
        "train",
        f"run.output_dir={run}",
        f"trainer.model_path={tiny_model_path}",
        "trainer.algorithm.advantage={type: on_policy_distill, reward_weight: 0.5}",
        "trainer.backend=fsdp2",
        "trainer.world_size=2",
        f"distill.teacher_model_path={teacher}",
        "rl.max_steps=3",
        "rl.groups_per_step=4",
        "rl.group_size=4",
        "orchestrator.max_new_tokens=6",
        timeout=280,
    )
    steps = [
        json.loads(line) for line in (run / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in steps] == [1, 2, 3]
    # Two random models (near-uniform both): the student's divergence from the teacher
    # on its own samples is small but there (measured 0.033, 0.025, 0.017; that it
    # falls is test_the_student_moves_toward_the_teacher's to show, over more steps).
    kls = [(row["teacher_kl"], row["sequences"]) for row in steps]
    assert all(0 < kl < 1 and sequences == 16 for kl, sequences in kls), kls
    # The teacher-server scored; the student's rollout-server did not.
    assert "rollout_scored_tokens" in (run / "logs" / "teacher-server.log").read_text()
    assert "rollout_scored_tokens" not in (run / "logs" / "rollout-server.log").read_text()


def test_an_evaluation_of_a_distillation_run_starts_no_teacher(tmp_path, tiny_model_path) -> None:
    """`rollwire eval` with an on-policy distillation config: the held-out reward of the
    checkpoint, with no teacher-server (the evaluation scores no tokens) and no buffer
    (it sends no trajectories)."""
    out = rollwire(
        tmp_path,
        "eval",
        f"run.output_dir={tmp_path / 'run'}",
        "trainer.algorithm.advantage={type: on_policy_distill}",
        f"distill.teacher_model_path={tmp_path / 'no-such-teacher'}",
        extra=["--checkpoint", str(tiny_model_path)],
    )
    assert "greedy_reward" in out
    logs = tmp_path / "run" / "evals" / tiny_model_path.name / "logs"
    assert (logs / "rollout-server.log").exists() and not (logs / "teacher-server.log").exists()
    assert not (logs / "buffer.log").exists()
