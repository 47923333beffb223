"""`rollwire sft`: supervised fine-tuning on a dataset file, with every trainer backend,
LoRA, held-out loss, checkpoints and resume; its model then starts `rollwire train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollwire.trainer.pipelines.common import batches
from tests.helpers.runs import chain_sum_files, jsonl, rollwire


def test_batches_cover_every_row_once_an_epoch_in_a_seeded_order() -> None:
    steps = batches(10, 4, 2, seed=3)
    assert [len(b) for b in steps] == [4, 4, 2, 4, 4, 2]
    assert sorted(i for b in steps[:3] for i in b) == list(range(10))
    assert steps[:3] != steps[3:]  # a new order each epoch
    assert batches(10, 4, 2, seed=3) == steps and batches(10, 4, 2, seed=4) != steps


def test_sft_without_data_says_what_it_needs(tmp_path) -> None:
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollwire.services.app.cli",
            "sft",
            "--set",
            f"run.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1 and "rollwire sft needs sft.data" in done.stderr


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_sft_from_scratch_then_rl_on_its_model(tmp_path) -> None:
    """The built-in tiny model, untrained, fine-tuned on a chain_sum file: the held-out
    loss falls and the held-out greedy reward rises from 0; `rollwire train` then starts
    from the folder it wrote and improves it further."""
    data = chain_sum_files(tmp_path / "data") / "sft.jsonl"
    run = tmp_path / "sft"
    out = rollwire(
        tmp_path,
        "sft",
        f"run.output_dir={run}",
        f"sft.data={data}",
        "sft.epochs=8",
        "sft.eval_every=100",
        "trainer.optimizer.learning_rate=0.003",
    )
    assert "held_out: " in out and "rows kept" in out  # what preparing the data counted
    metrics = jsonl(run / "metrics" / "sft.jsonl")
    evals = [row["eval_loss"] for row in metrics if "eval_loss" in row]
    # Measured 4.63 -> 0.48.
    assert evals[-1] < 0.25 * evals[0], evals
    final = run / "final"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(final).num_parameters() > 0
    assert not (final / "trainer_state.pt").exists()
    rollwire(tmp_path, "eval", f"run.output_dir={run}", extra=["--checkpoint", str(final)])
    after_sft = json.loads((run / "evals" / "final" / "eval.json").read_text())["greedy_reward"]
    # Measured 0.325 on the 200 held-out prompts (the untrained model scores 0).
    assert after_sft >= 0.15, after_sft
    rl = tmp_path / "rl"
    rollwire(
        tmp_path,
        "train",
        f"run.output_dir={rl}",
        f"trainer.model_path={final}",
        "rl.max_steps=40",
        "orchestrator.eval_every=20",
        timeout=400,
    )
    curve = [row["eval_reward"] for row in jsonl(rl / "metrics" / "eval.jsonl")]
    assert curve[0] == pytest.approx(after_sft)
    # Measured 0.325 -> 0.365 -> 0.385.
    assert max(curve[1:]) > curve[0], curve


def _sft_run(tmp_path: Path, name: str, data: Path, *sets: str) -> list[dict]:
    run = tmp_path / name
    rollwire(
        tmp_path,
        "sft",
        f"run.output_dir={run}",
        f"sft.data={data}",
        "sft.max_steps=6",
        "sft.batch_size=8",
        "sft.eval_every=3",
        "trainer.optimizer.learning_rate=0.003",
        "trainer.batching.micro_batch_size=3",
        *sets,
    )
    return jsonl(run / "metrics" / "sft.jsonl")


COMPARED = ("loss", "tokens", "grad_norm", "learning_rate", "eval_loss")


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_sft_on_two_fsdp2_ranks_equals_one_process_and_lora_trains(tmp_path) -> None:
    data = chain_sum_files(tmp_path / "data", rows=300) / "sft.jsonl"
    # Packed rows (sft.packing) on both: the split over ranks is by packed rows.
    local = _sft_run(tmp_path, "local", data, "sft.packing=true", "sft.max_length=64")
    sharded = _sft_run(
        tmp_path,
        "fsdp2",
        data,
        "trainer.backend=fsdp2",
        "trainer.world_size=2",
        "sft.packing=true",
        "sft.max_length=64",
    )
    assert [row["step"] for row in sharded] == list(range(7))
    assert all(row["rows"] < 8 for row in local if "rows" in row)  # 8 examples a step, packed
    for ours, theirs in zip(sharded, local, strict=True):
        for key in COMPARED:
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (ours["step"], key)
    lora = _sft_run(tmp_path, "lora", data, "trainer.lora={rank: 4, alpha: 8}")
    losses = [row["eval_loss"] for row in lora if "eval_loss" in row]
    assert losses[-1] < losses[0], losses
    from transformers import AutoModelForCausalLM

    assert (tmp_path / "lora" / "final" / "adapter").is_dir()
    AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "final")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_stopped_sft_resumes_from_its_checkpoint_exactly(tmp_path) -> None:
    data = chain_sum_files(tmp_path / "data", rows=300) / "sft.jsonl"
    straight = _sft_run(tmp_path, "straight", data, "sft.checkpoint_every=2")
    # A run that stops after step 4 (its newest checkpoint is step 2's: the last step
    # writes only the final model), then is started again for all 6.
    first = _sft_run(tmp_path, "cut", data, "sft.checkpoint_every=2", "sft.max_steps=4")
    again = _sft_run(tmp_path, "cut", data, "sft.checkpoint_every=2")[len(first) :]
    assert [row["step"] for row in again] == [3, 4, 5, 6]
    for ours in again:
        theirs = next(row for row in straight if row["step"] == ours["step"])
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6), ours["step"]
    assert (tmp_path / "cut" / "checkpoints" / "step_000002").is_dir()


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_sft_and_dpo_on_cuda_ranks(tmp_path) -> None:
    """`rollwire sft` then `rollwire dpo` with fsdp2 ranks on CUDA (up to two GPUs, NCCL),
    bf16: both run to their final model, and the fine-tuning loss falls."""
    import torch

    ranks = min(2, torch.cuda.device_count())
    data = chain_sum_files(tmp_path / "data", off_by_one=0.6, rows=600)
    cuda = ["trainer.device=cuda", "trainer.precision=bf16", "trainer.backend=fsdp2"]
    cuda.append(f"trainer.world_size={ranks}")
    sft = _sft_run(tmp_path, "sft", data / "sft.jsonl", "sft.max_steps=20", *cuda)
    losses = [row["eval_loss"] for row in sft if "eval_loss" in row]
    assert losses[-1] < losses[0], losses
    rollwire(
        tmp_path,
        "dpo",
        f"run.output_dir={tmp_path / 'dpo'}",
        f"trainer.model_path={tmp_path / 'sft' / 'final'}",
        f"dpo.data={data / 'pairs.jsonl'}",
        "dpo.max_steps=5",
        "dpo.sft_weight=1.0",
        *cuda,
    )
    assert (tmp_path / "dpo" / "final" / "config.json").exists()


def test_the_warm_up_is_the_sft_step_and_equals_the_loop_it_replaced(
    tiny_model_path, tmp_path
) -> None:
    """`warm_up_on` trains through `SupervisedStep`; its schedule and optimizer are
    the warm-up's own, calibrated ones: batch for batch it gives the weights of a plain
    loop (HF's loss on the taught tokens, fused AdamW, clip 1, ramp x linear decay), bit for bit."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from rollwire.trainer.pipelines.warmup import warm_up_on

    steps, size = 25, 8

    def batch(rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
        rows = []
        for _ in range(count):
            prompt, answer = rng.randint(3, 8), rng.randint(4, 12)
            rows.append(
                ([rng.randint(3, 90) for _ in range(prompt + answer)], [0] * prompt + [1] * answer)
            )
        return rows

    out = warm_up_on(tiny_model_path, tmp_path / "warm", batch, steps, size, 3e-3, 0, 1, False)
    ours = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    # The trainer's AdamW: torch's fused kernel on CPU (`AdamWSettings.build`).
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / steps)
    )
    rng = random.Random(0)
    for _ in range(steps):
        rows = batch(rng, size)
        width = max(len(ids) for ids, _ in rows)
        ids = torch.zeros((size, width), dtype=torch.long)
        labels = torch.full((size, width), -100)
        attention = torch.zeros((size, width), dtype=torch.long)
        for row, (tokens, taught) in enumerate(rows):
            values = torch.tensor(tokens)
            ids[row, : len(tokens)], attention[row, : len(tokens)] = values, 1
            labels[row, : len(tokens)] = torch.where(torch.tensor(taught) == 1, values, -100)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    for name, weight in model.named_parameters():
        assert torch.equal(weight.detach(), ours[name].detach()), name
