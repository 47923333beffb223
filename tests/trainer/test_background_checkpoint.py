"""Checkpoints written while the next steps run (`trainer.checkpointing.background`): what
the folder holds is the state at the step it was taken, a failed write leaves the
previous checkpoint whole, and the buffer commits only once the folder is in place."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.trainer.process import loop
from rollwire.trainer.process.servicer import TrainerState
from rollwire.trainer.rl.policy import Policy
from tests.helpers.trajectories import group


def make_policy(path, **settings) -> Policy:
    return Policy(
        path, TrainerConfig(optimizer={"learning_rate": 5e-2}, **settings), RLSection(group_size=4)
    )


def test_the_folder_holds_the_step_it_was_taken_at(tiny_model_path, tmp_path) -> None:
    policy = make_policy(tiny_model_path)
    policy.train_step(group(), 0)
    taken = {n: p.detach().clone() for n, p in policy.learner.model.named_parameters()}
    write = policy.checkpoint_writer(tmp_path / "step_000001", step=1, version=1)
    assert write is not None and not (tmp_path / "step_000001").exists()
    policy.train_step(group(), 1)  # the next step runs before the write
    moved = any(not torch.equal(p, taken[n]) for n, p in policy.learner.model.named_parameters())
    assert moved, "the step after the copy changed no weight: the test would prove nothing"
    folder = write()
    resumed = make_policy(tiny_model_path)
    state = resumed.restore(folder)
    assert (state["step"], state["policy_version"]) == (1, 1)
    assert resumed.learner.optimizer_steps == 1
    for name, param in resumed.learner.model.named_parameters():
        torch.testing.assert_close(param, taken[name], rtol=0, atol=0, msg=name)
    # The optimizer's moments are those of step 1 too: the resumed run's next step is
    # the straight run's second one, exactly.
    straight = make_policy(tiny_model_path)
    straight.train_step(group(), 0)
    straight.train_step(group(), 1)
    resumed.train_step(group(), 1)
    for (name, ours), theirs in zip(
        resumed.learner.model.named_parameters(), straight.learner.model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8, msg=name)


def test_a_failed_write_leaves_the_previous_checkpoint(tiny_model_path, tmp_path) -> None:
    policy = make_policy(tiny_model_path)
    folder = tmp_path / "step_000001"
    policy.save_checkpoint(folder, step=1, version=1)
    before = sorted(p.name for p in folder.iterdir())
    policy.train_step(group(), 1)
    # The same folder written again in the background, its model write failing midway.
    write = policy.checkpoint_writer(folder, step=2, version=2)
    model = policy.learner.model

    def broken(staging, **kwargs):
        (staging / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    model.save_pretrained = broken
    with pytest.raises(OSError, match="disk full"):
        write()
    assert sorted(p.name for p in folder.iterdir()) == before
    assert torch.load(folder / "trainer_state.pt", weights_only=False)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]  # no staging left


class Buffer:
    """Records commits, and whether the checkpoint's folder existed at each."""

    def __init__(self, folder) -> None:
        self.folder, self.commits = folder, []

    def commit(self, ids) -> None:
        self.commits.append((list(ids), self.folder.exists()))


def test_the_buffer_commits_once_the_folder_is_in_place(tiny_model_path, tmp_path) -> None:
    policy = make_policy(tiny_model_path)
    state = TrainerState()
    state.step, state.version = 3, 3
    state.uncommitted_ids = ["a", "b"]
    folder = tmp_path / "checkpoints" / "step_000003"
    buffer = Buffer(folder)

    async def scenario() -> list:
        request = asyncio.get_running_loop().create_future()
        state.checkpoint_requests.append(request)
        path = await loop.checkpoint(policy, state, tmp_path, buffer, background=True)
        assert path == str(folder) and state.writing is not None
        state.uncommitted_ids.append("c")  # trained while the checkpoint is written
        # The final checkpoint waits for the one on its way, then writes its own.
        state.step = 4
        await loop.checkpoint(policy, state, tmp_path, buffer)
        return [await request]

    answered = asyncio.run(scenario())
    assert answered == [str(folder)]
    assert buffer.commits == [(["a", "b"], True), (["c"], True)]
    assert state.uncommitted_ids == []
    assert state.last_checkpoint.endswith("step_000004")


def test_a_trainer_starting_up_removes_what_a_dead_one_left_half_written(tmp_path) -> None:
    from rollwire.services.core.files import latest_checkpoint, remove_unfinished_checkpoints

    checkpoints = tmp_path / "checkpoints"
    whole = checkpoints / "step_000003"
    whole.mkdir(parents=True)
    (whole / "trainer_state.pt").write_bytes(b"state")
    for name in (".step_000004.123.background", ".step_000004.partial"):
        (checkpoints / name).mkdir()
        (checkpoints / name / "model.safetensors").write_bytes(b"half")
    removed = remove_unfinished_checkpoints(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".step_000004.123.background",
        ".step_000004.partial",
    ]
    assert [p.name for p in checkpoints.iterdir()] == ["step_000003"]
    assert latest_checkpoint(tmp_path) == whole
