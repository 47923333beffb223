"""The trainer backends (trainer/backends/__init__.py): the token split, and one optimizer step of
fsdp2 and DeepSpeed ZeRO on two CPU ranks against the same step in one local process.

The multiproc tests run tests/helpers/backend_worker.py under `torchrun --standalone` (a free
port) in a process group of their own, killed by that group on a timeout. DeepSpeed's
first start on a machine compiles a shared-memory op (about a minute; cached under
~/.cache/torch_extensions afterwards; deploy/install.sh compiles it ahead), so without
that its first test may take that much longer.

Tolerances, float32: loss and weights within 1e-5 absolute, gradient norm within 1e-5
relative (seen on the tiny model: loss 1.2e-7, norm 2.6e-7 relative, weights 5.4e-7 for
FSDP2 and ZeRO-1/2, 1.1e-6 for ZeRO-3). bfloat16 FSDP2 (float32 master weights and
reductions): loss within 1e-3, gradient norm within 1e-2 relative, each weight within
2.5 learning rates per step taken (Adam moves a weight about one learning rate a step,
so a tiny gradient whose sign bf16 flips moves it by two) and the mean weight within
1e-4 (seen: loss 1.6e-4, norm 1.1e-3 relative, weights 3.1e-3 max and 1.1e-5 mean after
two steps). A resume from `save` gives bit-identical weights and the same next step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rollwire.services.core.config.distributed import DeepSpeedConfig, DistributedConfig
from rollwire.trainer.backends import split_by_tokens
from rollwire.trainer.backends.weights import buckets

WORKER = Path(__file__).parents[1] / "helpers" / "backend_worker.py"
POLICY_WORKER = Path(__file__).parents[1] / "helpers" / "policy_worker.py"
LR = 1e-3  # backend_worker.OPTIMIZER
FP32_ATOL = 1e-5
BF16 = {"loss": 1e-3, "norm_rel": 1e-2, "weight_per_step": 2.5 * LR, "weight_mean": 1e-4}

# ---------------------------------------------------------------- the token split


def test_split_balances_tokens_and_keeps_batch_order() -> None:
    lengths = [10, 3, 7, 7, 2, 9, 1]
    parts = split_by_tokens(lengths, 2)
    # Longest first to the lighter rank: 10|-, 10|9, 10|16, 17|16, 17|19, 19|19, then the
    # tie goes to the rank with fewer rows, then the lower one: 20|19.
    assert parts == [[0, 3, 4, 6], [1, 2, 5]]
    assert [sum(lengths[i] for i in p) for p in parts] == [20, 19]
    assert split_by_tokens(lengths, 2) == parts  # deterministic


def test_split_edge_cases() -> None:
    assert split_by_tokens([], 3) == [[], [], []]
    assert split_by_tokens([5, 4], 1) == [[0, 1]]
    assert split_by_tokens([5], 3) == [[0], [], []]
    # Equal lengths and zero lengths spread the rows too.
    assert split_by_tokens([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]
    assert split_by_tokens([0, 0, 0, 0], 2) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="world_size"):
        split_by_tokens([1], 0)
    with pytest.raises(ValueError, match="negative"):
        split_by_tokens([1, -1], 2)


@given(st.lists(st.integers(0, 500), max_size=60), st.integers(1, 8))
def test_split_is_a_partition_within_one_row_of_balance(lengths: list[int], world: int) -> None:
    parts = split_by_tokens(lengths, world)
    assert len(parts) == world
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p == sorted(p) for p in parts)
    sums = [sum(lengths[i] for i in p) for p in parts]
    # Greedy to the least loaded rank: no rank ends more than one row above another.
    assert max(sums) - min(sums) <= max(lengths, default=0)
    if len(lengths) >= world:
        assert all(parts)


def test_buckets_bound_the_gathered_bytes() -> None:
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([4, 4, 10, 1])]
    groups = [[name for name, _ in b] for b in buckets(params, bucket_bytes=32)]
    assert groups == [["p0", "p1"], ["p2"], ["p3"]]  # 16+16 bytes, 40 alone, 4


def test_deepspeed_settings_are_checked() -> None:
    assert DistributedConfig().deepspeed.zero_stage == 2
    with pytest.raises(ValidationError, match="zero_stage 3"):
        DeepSpeedConfig(zero_stage=2, offload_params=True)
    with pytest.raises(ValidationError):
        DeepSpeedConfig(zero_stage=4)


def test_the_trainer_section_builds_its_backend(tiny_model_path: Path) -> None:
    from rollwire.services.core.config import TrainerConfig
    from rollwire.trainer.backends import LocalBackend, backend_for

    config = TrainerConfig(
        learning_rate=3e-4,
        weight_decay=0.1,
        adam_betas=(0.8, 0.9),
        adam_eps=1e-6,
        gradient_checkpointing=True,
    )
    backend = backend_for(config, tiny_model_path)
    assert isinstance(backend, LocalBackend)
    assert (backend.rank, backend.world_size, backend.is_main) == (0, 1, True)
    group = backend.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (
        3e-4,
        0.1,
        (0.8, 0.9),
        1e-6,
    )
    assert backend.module.is_gradient_checkpointing
    backend.set_lr(1e-5)
    assert all(g["lr"] == 1e-5 for g in backend.optimizer.param_groups)
    assert backend.reduce_metrics({"a": 2.0}, "sum") == {"a": 2.0}
    assert backend.broadcast_object([1]) == [1]
    with pytest.raises(ValueError, match="reduction"):
        backend.reduce_metrics({"a": 1.0}, "median")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the backends on two ranks


def _run(args: list[str], timeout: float) -> None:
    """Runs a command in a process group of its own; on a timeout kills that group."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",  # a rank that aborts prints its Python stack
    }
    process = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate(timeout=10)
        raise AssertionError(f"{args} ran past {timeout}s:\n{out[-6000:]}") from None
    assert process.returncode == 0, f"{args} exited {process.returncode}:\n{out[-6000:]}"


def _worker(
    model: Path,
    out: Path,
    *options: str,
    ranks: int = 2,
    timeout: float = 120,
    script: Path = WORKER,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = [str(script), "--model", str(model), "--out", str(out), *options]
    if ranks == 0:  # one plain process: the local reference
        _run([sys.executable, *args], timeout)
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        _run([*launcher, "--nproc-per-node", str(ranks), *args], timeout)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    assert a.keys() == b.keys()
    diffs = [(a[k] - b[k]).abs() for k in a]
    total = sum(d.numel() for d in diffs)
    return max(float(d.max()) for d in diffs), float(sum(d.sum() for d in diffs)) / total


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same two steps in one local process (and its resume)."""
    out = tmp_path_factory.mktemp("local")
    _worker(tiny_model_path, out, "--backend", "local", ranks=0)
    _worker(tiny_model_path, out, "--backend", "local", "--phase", "resume", ranks=0)
    return out


def _check_resume(out: Path, results: dict) -> None:
    resumed = json.loads((out / "resume.json").read_text())
    for stem in ("weights1", "weights2"):
        saved = _weights(out / f"{stem}.safetensors")
        loaded = _weights(out / f"resumed_{stem}.safetensors")
        assert saved.keys() == loaded.keys()
        assert all(torch.equal(saved[k], loaded[k]) for k in saved), stem
    assert (resumed["loss2"], resumed["norm2"]) == (results["loss2"], results["norm2"])


@pytest.mark.multiproc
def test_local_backend_saves_loads_and_writes_a_pretrained_folder(
    reference: Path, tiny_model_path: Path
) -> None:
    results = json.loads((reference / "train.json").read_text())
    _check_names_and_pretrained(reference, results, tiny_model_path)
    _check_resume(reference, results)


CASES = {
    "fsdp2": (["--backend", "fsdp2"], True),
    "zero2": (["--backend", "deepspeed", "--zero-stage", "2"], True),
    "zero3": (["--backend", "deepspeed", "--zero-stage", "3"], True),
    "fsdp2-checkpointing": (["--backend", "fsdp2", "--gradient-checkpointing"], False),
    "zero1-checkpointing": (
        ["--backend", "deepspeed", "--zero-stage", "1", "--gradient-checkpointing"],
        False,
    ),
    "zero2-offload": (
        ["--backend", "deepspeed", "--zero-stage", "2", "--offload-optimizer"],
        False,
    ),
}


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_like_one_process_and_resume_exactly(
    case: str, reference: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    options, resume = CASES[case]
    timeout = 360 if "deepspeed" in options else 120  # DeepSpeed's first op compile
    _worker(tiny_model_path, tmp_path, *options, timeout=timeout)
    ours = json.loads((tmp_path / "train.json").read_text())
    local = json.loads((reference / "train.json").read_text())
    assert ours["world_size"] == 2
    assert ours["checkpointing"] == ("--gradient-checkpointing" in options)
    # A step with NaN gradients is skipped, and says so by its norm.
    assert ours["poisoned_norm"] in ("nan", "inf") and ours["poisoned_changed"] == []
    for key in ("loss1", "loss2"):
        assert ours[key] == pytest.approx(local[key], abs=FP32_ATOL), key
    for key in ("norm1", "norm2"):
        assert ours[key] == pytest.approx(local[key], rel=FP32_ATOL), key
    for name in ("weights1", "weights2"):
        worst, _ = _max_diff(
            _weights(tmp_path / f"{name}.safetensors"), _weights(reference / f"{name}.safetensors")
        )
        assert worst <= FP32_ATOL, (name, worst)
    _check_names_and_pretrained(tmp_path, ours, tiny_model_path)
    if not resume:
        return
    _worker(tiny_model_path, tmp_path, *options, "--phase", "resume", timeout=timeout)
    _check_resume(tmp_path, ours)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "options",
    [
        ["--backend", "fsdp2", "--advantage", "gae"],
        ["--backend", "deepspeed", "--zero-stage", "3", "--advantage", "gae"],
    ],
    ids=["fsdp2-gae", "zero3-gae"],
)
def test_the_trainer_step_on_two_ranks_equals_one_process_and_resumes(
    options: list[str], tiny_model_path: Path, tmp_path: Path
) -> None:
    """`Policy.train_step` with rank 0 leading and rank 1 following: three minibatches
    split unevenly by tokens (padding passes), two epochs, the clip acting; the same
    metrics and weights as one local process, and a restore that carries on exactly; with
    `gae`, so the critic (a second sharded model) steps, saves and resumes with the policy.
    (Without a critic the policy's part is the same code: those two cases, 98 s of CI,
    checked nothing these do not.)"""
    timeout = 360 if "deepspeed" in options else 120
    local, ours = tmp_path / "local", tmp_path / "ours"
    extra = options[options.index("--advantage") :] if "--advantage" in options else []
    _worker(tiny_model_path, local, "--backend", "local", *extra, ranks=0, script=POLICY_WORKER)
    _worker(tiny_model_path, ours, *options, timeout=timeout, script=POLICY_WORKER)
    theirs = json.loads((local / "policy_train.json").read_text())
    results = json.loads((ours / "policy_train.json").read_text())
    assert (results["world_size"], theirs["world_size"]) == (2, 1)
    assert theirs["step1"]["clip_frac_high"] > 0 and theirs["step1"]["optimizer_steps"] == 6
    for step in ("step1", "step2"):
        for key, value in theirs[step].items():
            assert results[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    for name in ("policy1", "train2"):
        worst, _ = _max_diff(
            _weights(ours / f"{name}.safetensors"), _weights(local / f"{name}.safetensors")
        )
        assert worst <= FP32_ATOL, (name, worst)
    # The checkpoint: a Hugging Face folder of the consolidated weights, the sharded
    # state beside it; a restore on two ranks steps exactly as the run went on.
    from transformers import AutoModelForCausalLM

    folder = ours / "policy_checkpoint"
    assert (folder / "backend").is_dir()
    assert (folder / "critic").is_dir()
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    saved = _weights(ours / "policy1.safetensors")
    assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    _worker(
        tiny_model_path, ours, *options, "--phase", "resume", timeout=timeout, script=POLICY_WORKER
    )
    resumed = json.loads((ours / "policy_resume.json").read_text())
    assert resumed["restored"] == [1, 1, ["t0"]]
    assert resumed["step2"] == results["step2"]
    for first, again in (("policy1", "restored1"), ("train2", "resume2")):
        a, b = _weights(ours / f"{first}.safetensors"), _weights(ours / f"{again}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), (first, again)


def _check_names_and_pretrained(out: Path, results: dict, model_path: Path) -> None:
    """Every parameter by its Hugging Face name and shape; the consolidated folder loads
    and holds exactly the weights gathered after step 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert results["shapes"] == {n: list(p.shape) for n, p in fresh.named_parameters()}
    assert results["specs"] == results["shapes"]  # known before gathering
    assert list(results["specs"]) == list(results["shapes"])  # and in the same order
    folder = out / "pretrained"
    assert (folder / "model.safetensors.index.json").exists()  # sharded: 64 KiB shards
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gathered = _weights(out / "weights1.safetensors")
    params = dict(loaded.named_parameters())
    assert params.keys() == gathered.keys()
    assert all(torch.equal(params[k].detach(), gathered[k]) for k in gathered)
    assert loaded.config.tie_word_embeddings == fresh.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(folder).encode("abc") == AutoTokenizer.from_pretrained(
        model_path
    ).encode("abc")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_bf16_fsdp2_steps_close_to_float32(
    reference: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    _worker(tiny_model_path, tmp_path, "--backend", "fsdp2", "--precision", "bf16")
    ours = json.loads((tmp_path / "train.json").read_text())
    local = json.loads((reference / "train.json").read_text())
    for key in ("loss1", "loss2"):
        assert ours[key] == pytest.approx(local[key], abs=BF16["loss"]), key
    for key in ("norm1", "norm2"):
        assert ours[key] == pytest.approx(local[key], rel=BF16["norm_rel"]), key
    for steps, name in ((1, "weights1"), (2, "weights2")):
        worst, mean = _max_diff(
            _weights(tmp_path / f"{name}.safetensors"), _weights(reference / f"{name}.safetensors")
        )
        assert worst <= BF16["weight_per_step"] * steps, (name, worst)
        assert mean <= BF16["weight_mean"], (name, mean)
    _check_names_and_pretrained(tmp_path, ours, tiny_model_path)


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("backend", "advantage"), [("fsdp2", "grpo"), ("deepspeed", "gae")], ids=["fsdp2", "zero3-gae"]
)
def test_the_trainer_step_on_cuda_ranks_equals_one_cuda_process(
    backend: str, advantage: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """`Policy.train_step` led by rank 0 on one GPU per rank (up to two, NCCL), against
    the local step on GPU 0; then a restore on the same ranks carries on within 1e-6.
    The ZeRO-3 case trains a critic beside the policy (advantage: gae)."""
    ranks = min(2, torch.cuda.device_count())
    options = ["--backend", backend, "--device", "cuda", "--zero-stage", "3"]
    options += ["--advantage", advantage]
    local, ours = tmp_path / "local", tmp_path / "ours"
    _worker(
        tiny_model_path,
        local,
        "--backend",
        "local",
        "--device",
        "cuda",
        "--advantage",
        advantage,
        ranks=0,
        script=POLICY_WORKER,
    )
    _worker(tiny_model_path, ours, *options, ranks=ranks, timeout=300, script=POLICY_WORKER)
    theirs = json.loads((local / "policy_train.json").read_text())
    results = json.loads((ours / "policy_train.json").read_text())
    for step in ("step1", "step2"):
        for key, value in theirs[step].items():
            assert results[step][key] == pytest.approx(value, rel=1e-4, abs=1e-4), (step, key)
    worst, _ = _max_diff(
        _weights(ours / "train2.safetensors"), _weights(local / "train2.safetensors")
    )
    assert worst <= 1e-4
    _worker(
        tiny_model_path,
        ours,
        *options,
        "--phase",
        "resume",
        ranks=ranks,
        timeout=300,
        script=POLICY_WORKER,
    )
    again = _weights(ours / "resume2.safetensors")
    saved = _weights(ours / "train2.safetensors")
    assert max(float((saved[k] - again[k]).abs().max()) for k in saved) <= 1e-6


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["fsdp2", "zero3"])
def test_cuda_ranks_over_nccl_step_like_one_process(
    case: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """The NCCL path: one rank per GPU (up to two), against the local step on GPU 0."""
    ranks = min(2, torch.cuda.device_count())
    options, _ = CASES[case]
    local = tmp_path / "local"
    _worker(tiny_model_path, local, "--backend", "local", "--device", "cuda", ranks=0)
    _worker(
        tiny_model_path, tmp_path / "ours", *options, "--device", "cuda", ranks=ranks, timeout=540
    )
    _worker(
        tiny_model_path,
        tmp_path / "ours",
        *options,
        "--device",
        "cuda",
        "--phase",
        "resume",
        ranks=ranks,
        timeout=300,
    )
    ours = json.loads((tmp_path / "ours" / "train.json").read_text())
    theirs = json.loads((local / "train.json").read_text())
    assert ours["world_size"] == ranks
    for key in ("loss1", "loss2", "norm1", "norm2"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-4), key
    for name in ("weights1", "weights2"):
        worst, _ = _max_diff(
            _weights(tmp_path / "ours" / f"{name}.safetensors"),
            _weights(local / f"{name}.safetensors"),
        )
        assert worst <= 1e-4, (name, worst)
    saved = _weights(tmp_path / "ours" / "weights2.safetensors")
    again = _weights(tmp_path / "ours" / "resumed_weights2.safetensors")
    assert max(float((saved[k] - again[k]).abs().max()) for k in saved) <= 1e-6
    _check_names_and_pretrained(tmp_path / "ours", ours, tiny_model_path)
