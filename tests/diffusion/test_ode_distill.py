"""`rollwire ode-distill`: the teacher's trajectories made by a diffusion rollout-server into a
resumable, fingerprinted folder, and a student trained on them, evaluated at 1, 2 and 4
steps against the teacher, resuming exactly from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollwire.diffusion.ode_pairs import (
    PairSettings,
    file_trajectories,
    load_pairs,
    missing_files,
    pair_seed,
    prepare_folder,
    write_file,
)
from tests.helpers.runs import command_line, jsonl, rollwire

SMALL = [
    "ode_distill.pairs=120",
    "ode_distill.data_batch=50",
    "ode_distill.teacher_steps=16",
    "ode_distill.nodes=[0, 4, 8]",
    "ode_distill.batch_size=32",
    "ode_distill.eval_per_class=10",
    "ode_distill.eval_every=0",
]


def settings(**changes) -> PairSettings:
    base = {
        "teacher": "ab" * 32,
        "steps": 8,
        "guidance": 1.0,
        "shift": 1.0,
        "nodes": (0, 4),
        "seed": 3,
        "per_file": 4,
    }
    return PairSettings(**{**base, **changes})


def test_a_pairs_folder_is_filled_file_by_file_and_refuses_other_settings(tmp_path) -> None:
    made = settings()
    prepare_folder(tmp_path, made)
    assert missing_files(tmp_path, made, 10) == [0, 1, 2]
    assert list(file_trajectories(2, made, 10)) == [8, 9]
    rng = np.random.default_rng(0)
    for index in (0, 2):
        count = len(file_trajectories(index, made, 10))
        write_file(
            tmp_path,
            index,
            rng.normal(size=(count, 2, 1, 8, 8)),
            rng.normal(size=(count, 1, 8, 8)),
            np.arange(count) % 10,
            np.arange(count),
        )
    assert missing_files(tmp_path, made, 10) == [1]
    # Asked for 12, the short last file (2 of its 4) is made again whole.
    assert missing_files(tmp_path, made, 12) == [1, 2]
    with pytest.raises(ValueError, match="pairs-000001.npz is missing"):
        load_pairs(tmp_path, 10)
    assert len(load_pairs(tmp_path, 4)) == 4 and load_pairs(tmp_path, 4).times == [1.0, 0.5]
    prepare_folder(tmp_path, made)  # the same settings: fine
    with pytest.raises(ValueError, match=r"other settings \(guidance, steps differ"):
        prepare_folder(tmp_path, settings(steps=16, guidance=2.0))
    seeds = {pair_seed(3, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 1 << 62 for s in seeds)
    assert pair_seed(3, 7) == pair_seed(3, 7) != pair_seed(4, 7)


def test_evaluation_seeds_past_an_offset_are_the_next_ones_of_the_range() -> None:
    """`benchmarks/distill_quality.py --offset` measures on a second, disjoint set: the
    seeds after the first set's, with the same noise as the longer range gives them."""
    from rollwire.diffusion.ode_pairs import EVAL_SEED_BASE
    from rollwire.trainer.pipelines.student_quality import evaluation_noise

    noise, labels, seeds = evaluation_noise(2)
    later, later_labels, later_seeds = evaluation_noise(1, offset=10)
    assert seeds[0] == EVAL_SEED_BASE and later_seeds == seeds[10:]
    assert np.array_equal(later.numpy(), noise[10:].numpy())
    assert later_labels.tolist() == labels[10:].tolist() == list(range(10))
    with pytest.raises(ValueError, match="cannot be negative"):
        evaluation_noise(1, offset=-1)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_pairs_resume_and_the_student_is_measured_against_the_teacher(
    tmp_path, teacher
) -> None:
    pairs = tmp_path / "pairs"
    small = [*SMALL, f"ode_distill.teacher_model_path={teacher}"]
    out = rollwire(
        tmp_path,
        "ode-distill",
        f"run.output_dir={tmp_path / 'run'}",
        f"ode_distill.data={pairs}",
        *small,
    )
    assert "pairs: 3 files to make" in out, out
    folder = load_pairs(pairs)
    assert len(folder) == 120 and folder.latents.shape == (120, 3, 1, 8, 8)
    assert folder.times == [1.0, 0.75, 0.5]
    assert sorted(set(folder.labels.tolist())) == list(range(10))
    # The first node is the trajectory's noise, as its seed draws it.
    import torch

    first = torch.randn((1, 8, 8), generator=torch.Generator().manual_seed(int(folder.seeds[0])))
    assert np.allclose(folder.latents[0, 0], first.numpy(), atol=1e-6)
    rows = jsonl(tmp_path / "run" / "metrics" / "ode-distill.jsonl")
    measured = [row for row in rows if "steps1_frechet" in row]
    assert [row["step"] for row in measured] == [0, rows[-1]["step"]]
    for count in (1, 2, 4):
        assert {f"steps{count}_{k}" for k in ("frechet", "diversity", "accuracy")} <= set(rows[-1])
    record = json.loads((tmp_path / "run" / "metrics" / "ode-distill-teacher.json").read_text())
    assert record["teacher_steps"] == 16
    assert set(record["teacher"]) == {"accuracy", "frechet", "diversity"}
    assert "student at 1 step(s): frechet" in out
    for name in ("teacher", "steps1", "steps2", "steps4"):
        assert (tmp_path / "run" / "metrics" / "images" / f"{name}.png").exists()
    # More pairs later: the new file, and the short last one (20 of its 50) made again
    # whole, so all 160 are there; other settings: refused.
    more = rollwire(
        tmp_path,
        "ode-distill",
        f"run.output_dir={tmp_path / 'more'}",
        f"ode_distill.data={pairs}",
        *small,
        "ode_distill.pairs=160",
        "ode_distill.max_steps=1",
    )
    assert "pairs: 2 files to make" in more, more
    assert "data: 160 teacher trajectories" in more, more
    import subprocess

    from tests.helpers.runs import child_env

    refused = subprocess.run(
        command_line(
            "ode-distill",
            f"run.output_dir={tmp_path / 'other'}",
            f"ode_distill.data={pairs}",
            *small,
            "ode_distill.guidance=2.0",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert refused.returncode == 1 and "other settings (guidance differ" in refused.stderr


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_stopped_student_resumes_from_its_checkpoint_exactly(tmp_path, teacher) -> None:
    """The losses and the EMA's samples of a run stopped at step 4 and resumed from its
    step-2 checkpoint equal an unbroken run's (the loss with the perceptual distance in
    the teacher's features beside the squared error)."""
    pairs = tmp_path / "pairs"
    small = [*SMALL, f"ode_distill.teacher_model_path={teacher}"]

    def run(name: str, *sets: str) -> list[dict]:
        rollwire(
            tmp_path,
            "ode-distill",
            f"run.output_dir={tmp_path / name}",
            f"ode_distill.data={pairs}",
            *small,
            "ode_distill.checkpoint_every=2",
            "ode_distill.eval_steps=[1]",
            "ode_distill.ema_decay=0.5",
            "ode_distill.feature_weight=2.0",
            *sets,
        )
        return jsonl(tmp_path / name / "metrics" / "ode-distill.jsonl")

    straight = run("straight", "ode_distill.max_steps=6")
    first = run("cut", "ode_distill.max_steps=4")
    again = run("cut", "ode_distill.max_steps=6")[len(first) :]
    assert [row["step"] for row in again] == [3, 4, 5, 6]
    for ours in again:
        theirs = next(row for row in straight if row["step"] == ours["step"])
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6), ours["step"]
    # The evaluation after the last step samples the EMA, restored from step 2's checkpoint.
    assert again[-1]["steps1_frechet"] == pytest.approx(straight[-1]["steps1_frechet"], rel=1e-6)
    assert straight[-1]["steps1_frechet"] != pytest.approx(straight[0]["steps1_frechet"])
    assert Path(tmp_path / "cut" / "checkpoints" / "step_000002" / "ema").is_dir()
    assert (tmp_path / "cut" / "final_ema" / "config.json").exists()
