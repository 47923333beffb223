"""The flow-denoiser family on the sharded backends: Flow-GRPO's and reward feedback
learning's steps on two ranks (fsdp2, DeepSpeed ZeRO-3) equal one local process, the
ranks splitting each minibatch unevenly, and the checkpoint is a diffusers folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rollwire.diffusion.digits import DigitsSpec, build_digits_model
from tests.trainer.test_backends import _max_diff, _run, _weights

WORKER = Path(__file__).parents[1] / "helpers" / "diffusion_worker.py"
FP32_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("digits") / "model"
    return build_digits_model(folder, DigitsSpec(steps=2, batch_size=8), progress=False)


@pytest.fixture(scope="module")
def local(model_path: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local")
    _run(
        [
            sys.executable,
            str(WORKER),
            "--backend",
            "local",
            "--model",
            str(model_path),
            "--out",
            str(out),
        ],
        120,
    )
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "options",
    [["--backend", "fsdp2"], ["--backend", "deepspeed", "--zero-stage", "3"]],
    ids=["fsdp2", "zero3"],
)
def test_diffusion_steps_on_two_ranks_equal_one_process(
    options: list[str], model_path: Path, local: Path, tmp_path: Path
) -> None:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    timeout = 360 if "deepspeed" in options else 120  # DeepSpeed's first op compile
    _run(
        [*launcher, str(WORKER), *options, "--model", str(model_path), "--out", str(tmp_path)],
        timeout,
    )
    ours = json.loads((tmp_path / "results.json").read_text())
    theirs = json.loads((local / "results.json").read_text())
    assert (ours.pop("world_size"), theirs.pop("world_size")) == (2, 1)
    assert theirs["flow_grpo0"]["mismatch"] is not None and theirs["flow_grpo1"]["mismatch"] is None
    for step, metrics in theirs.items():
        for key, value in metrics.items():
            if value is None:
                assert ours[step][key] is None, (step, key)
            else:
                assert ours[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    for name in ("flow_grpo", "reward_fl"):
        worst, _ = _max_diff(
            _weights(tmp_path / f"{name}.safetensors"), _weights(local / f"{name}.safetensors")
        )
        assert worst <= FP32_ATOL, (name, worst)
    # The checkpoint holds a consolidated UNet diffusers loads, with its scheduler.
    from diffusers import UNet2DModel

    folder = tmp_path / "checkpoint"
    assert (folder / "scheduler").is_dir() and (
        folder / "diffusion_pytorch_model.safetensors"
    ).exists()
    loaded = UNet2DModel.from_pretrained(folder).state_dict()
    saved = _weights(tmp_path / "reward_fl.safetensors")
    assert all(torch.equal(loaded[name], saved[name]) for name in saved)
