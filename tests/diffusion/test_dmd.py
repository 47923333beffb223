"""`rollwire dmd`: the teacher served over `Denoise` by a diffusion rollout-server, the
generator and the fake score trained in the trainer (with DMD2's GAN head, a two-step
schedule and an EMA here), measured against the teacher, and resuming exactly from a
checkpoint. The DMD direction and the losses are checked by hand in test_distill_math.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import child_env, command_line, jsonl, rollwire

SMALL = [
    "dmd.batch_size=16",
    "dmd.fake_updates=2",
    "dmd.teacher_steps=8",
    "dmd.eval_per_class=5",
    "dmd.eval_steps=[1, 2]",
    "dmd.eval_every=0",
    "dmd.student_steps=2",
    "dmd.gan_weight=0.1",
    "dmd.ema_decay=0.9",
    "dmd.guidance=1.5",
]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_dmd_trains_both_models_and_resumes_exactly(tmp_path, teacher) -> None:
    small = [*SMALL, f"dmd.teacher_model_path={teacher}", "dmd.checkpoint_every=2"]

    def run(name: str, steps: int) -> tuple[str, list[dict]]:
        out = rollwire(
            tmp_path, "dmd", f"run.output_dir={tmp_path / name}", *small, f"dmd.steps={steps}"
        )
        return out, jsonl(tmp_path / name / "metrics" / "dmd.jsonl")

    out, straight = run("straight", 5)
    assert "student at 2 step(s): frechet" in out and "its EMA" in out, out
    measured = [row for row in straight if "steps1_frechet" in row]
    assert [row["step"] for row in measured] == [0, 5]
    for row in straight[1:]:
        assert row["teacher_seconds"] > 0 and row["dmd_direction"] > 0
        assert {"fake_loss", "gan_head_loss", "gan_generator_loss", "dmd_loss"} <= set(row)
    record = json.loads((tmp_path / "straight" / "metrics" / "dmd-teacher.json").read_text())
    assert record["teacher_steps"] == 8 and set(record["teacher"]) == {
        "accuracy",
        "frechet",
        "diversity",
    }
    run_dir = tmp_path / "straight"
    checkpoint = run_dir / "checkpoints" / "step_000002"
    for name in (
        "fake_score/trainer_state.pt",
        "gan_head.pt",
        "ema/config.json",
        "trainer_state.pt",
    ):
        assert (checkpoint / name).exists(), name
    assert (run_dir / "final_ema" / "rollwire_diffusion.json").exists()
    assert (run_dir / "metrics" / "dmd.png").exists()
    # The fake score trained: its weights left the teacher's.
    from rollwire.trainer.models.flow_denoiser import FlowDenoiser

    family = FlowDenoiser()
    start, fake = family.load_weights(teacher), family.load_weights(checkpoint / "fake_score")
    assert any(not (start[k] == fake[k]).all() for k in start)

    # Stopped after step 3 (its checkpoint at 2), then carried on to 5: steps 3-5 again,
    # as the unbroken run drew and computed them.
    _, first = run("cut", 3)
    _, both = run("cut", 5)
    again = both[len(first) :]
    assert [row["step"] for row in again] == [3, 4, 5]
    for ours in again:
        theirs = straight[ours["step"]]
        for key in ("fake_loss", "dmd_loss", "gan_head_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (ours["step"], key)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_dmd_refuses_a_sharded_trainer(tmp_path, teacher) -> None:
    refused = subprocess.run(
        command_line(
            "dmd",
            f"run.output_dir={tmp_path / 'run'}",
            f"dmd.teacher_model_path={teacher}",
            "trainer.backend=fsdp2",
        ),
        capture_output=True,
        text=True,
        timeout=100,
        env=child_env(),
    )
    assert refused.returncode == 1 and "trainer.backend must be local" in refused.stderr
