"""The vision-language family in the trainer: chosen by the model folder, frozen by prefix,
its checkpoints loading with `from_pretrained` (processor included), and its steps on two
sharded ranks, one with images and one without, equal to one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollwire.services.core.config import RunConfig
from rollwire.trainer.learner import Learner
from rollwire.trainer.models import CausalLM, family_for
from rollwire.trainer.models.vision_lm import VisionLM
from rollwire.trainer.pipelines.table import CAUSAL_LM

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "vision_worker.py"


def _run(model: Path, out: Path, *options: str, ranks: int = 0) -> list[dict]:
    args = [str(WORKER), "--model", str(model), "--out", str(out), *options]
    if ranks:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        args = [*launcher, "--nproc-per-node", str(ranks), *args]
    else:
        args = [sys.executable, *args]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "steps.json").read_text())


@pytest.fixture(scope="module")
def local(tiny_vlm_path, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("vision-local")
    return out, _run(tiny_vlm_path, out)


def test_the_family_follows_the_model_folder_and_freezes_by_prefix(
    tiny_vlm_path, tiny_model_path
) -> None:
    assert isinstance(family_for(CAUSAL_LM, tiny_vlm_path), VisionLM)
    assert type(family_for(CAUSAL_LM, tiny_model_path)) is CausalLM
    config = RunConfig.model_validate({"trainer": {"freeze": ["model.visual"]}})
    learner = Learner(tiny_vlm_path, config.trainer, family_for(CAUSAL_LM, tiny_vlm_path, config))
    trained = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trained and not any(name.startswith("model.visual.") for name in trained)
    assert any(name.startswith("model.language_model.") for name in trained)
    typo = RunConfig.model_validate({"trainer": {"freeze": ["model.vision"]}})
    with pytest.raises(ValueError, match="'model.vision' names no parameter"):
        Learner(tiny_vlm_path, typo.trainer, family_for(CAUSAL_LM, tiny_vlm_path, typo))


def test_a_trained_vision_model_loads_with_from_pretrained(local, tiny_vlm_path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    out, steps = local
    assert steps[1]["norm"] < steps[0]["norm"]  # two steps on one batch: it learns it
    folder = out / "checkpoint"
    model = AutoModelForImageTextToText.from_pretrained(folder)
    start = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path)
    assert type(AutoImageProcessor.from_pretrained(folder)).__name__.startswith("Qwen2VL")
    assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|image_pad|>") == (
        model.config.image_token_id
    )
    weights, before = model.state_dict(), start.state_dict()
    # trainer.freeze kept the patch embedding as it was; the rest moved.
    frozen = "model.visual.patch_embed.proj.weight"
    assert torch.equal(weights[frozen], before[frozen])
    moved = [n for n in weights if n != frozen and not torch.equal(weights[n], before[n])]
    assert any(n.startswith("model.visual.blocks") for n in moved)
    assert any(n.startswith("model.language_model") for n in moved)


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_two_ranks_one_with_images_one_without_step_like_one_process(
    backend, local, tiny_vlm_path, tmp_path
) -> None:
    """Rank 0's micro-batch shows digits, rank 1's is text: without the blank image on
    rank 1 the ranks wait on each other's vision tower (measured: gloo's connection reset).
    ZeRO-3 for DeepSpeed: it gathers parameters in the forward, as fsdp2 does."""
    reference_out, reference = local
    ours = _run(tiny_vlm_path, tmp_path, "--backend", backend, ranks=2)
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine["norm"] == pytest.approx(theirs["norm"], rel=1e-5)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    b = load_file(str(reference_out / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_sft_on_image_rows_then_the_model_reads_held_out_digits(tmp_path) -> None:
    """`rollwire sft` on rows showing digits (by path in `messages` rows, by base64 in
    `prompt`/`completion` rows) makes the untrained tiny vision model read them: `rollwire
    eval` on the 297 held-out digits, which no row shows, scores well above chance
    (measured 0.697; chance is 0.1)."""
    import base64

    from tests.helpers.runs import jsonl, rollwire
    from tests.helpers.vision import digit_images

    (tmp_path / "pics").mkdir()
    rows = []
    for i, (image, label) in enumerate(digit_images(1200)):
        answer = f"<answer>{label}</answer>"
        if i % 2:
            (tmp_path / "pics" / f"{i}.png").write_bytes(image.data)
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": "Which digit is this?"},
                        {"role": "assistant", "content": answer},
                    ],
                    "images": [f"pics/{i}.png"],
                }
            )
        else:
            data = base64.b64encode(image.data).decode()
            rows.append(
                {
                    "prompt": "Which digit is this?",
                    "completion": answer,
                    "images": [{"data": data, "format": "png"}],
                }
            )
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "sft"
    common = [
        "run.tiny_model={vision: 1}",
        f"run.output_dir={run}",
        "orchestrator.eval_dataset={type: digits, split: held_out}",
        "orchestrator.prompt_template='{question}'",
        "orchestrator.max_new_tokens=8",
    ]
    rollwire(
        tmp_path,
        "sft",
        *common,
        f"sft.data={data}",
        "sft.epochs=8",
        "sft.eval_every=50",
        "trainer.optimizer.learning_rate=0.003",
    )
    evals = [row["eval_loss"] for row in jsonl(run / "metrics" / "sft.jsonl") if "eval_loss" in row]
    assert evals[-1] < 0.3 * evals[0], evals
    final = run / "final"
    assert (final / "preprocessor_config.json").exists()
    rollwire(tmp_path, "eval", *common, extra=["--checkpoint", str(final)])
    accuracy = json.loads((run / "evals" / "final" / "eval.json").read_text())["greedy_reward"]
    print(f"held-out digits read after SFT on 1200 rows with images: {accuracy}")
    assert accuracy >= 0.5, accuracy


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_dpo_on_image_pairs_learns_to_prefer_the_digit_shown(tmp_path) -> None:
    """`rollwire dpo` on pairs whose prompt shows a digit, the chosen answer that digit and
    the rejected one another drawn at random: only the picture tells them apart, so the
    297 held-out pairs (digits no pair shows) start at chance and end well above it
    (measured: 0.495 -> 0.758 with run.seed 0, 0.754 with seed 1). At a rate of 0.003 the
    held-out curve peaked near step 30 and then fell back to 0.62 on one machine kind
    and not on another: a rate at the edge of stability, where float rounding decides."""
    import random

    from rollwire.services.core.images import row_value
    from tests.helpers.runs import jsonl, rollwire
    from tests.helpers.vision import digit_images

    rng = random.Random(0)

    def pairs(name: str, count: int, first: int) -> Path:
        rows = []
        for image, label in digit_images(count, first):
            other = rng.choice([digit for digit in range(10) if digit != label])
            rows.append(
                {
                    "prompt": "Which digit is this?",
                    "chosen": f"<answer>{label}</answer>",
                    "rejected": f"<answer>{other}</answer>",
                    "images": [row_value(image)],
                }
            )
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    run = tmp_path / "dpo"
    rollwire(
        tmp_path,
        "dpo",
        "run.tiny_model={vision: 1}",
        f"run.output_dir={run}",
        f"dpo.data={pairs('train', 600, 0)}",
        f"dpo.eval_data={pairs('held', 297, 1500)}",
        "dpo.epochs=4",
        "dpo.batch_size=32",
        "dpo.eval_every=0",
        "trainer.optimizer.learning_rate=0.002",
    )
    evals = [row for row in jsonl(run / "metrics" / "dpo.jsonl") if "eval_prefers_chosen" in row]
    first, last = evals[0]["eval_prefers_chosen"], evals[-1]["eval_prefers_chosen"]
    print(f"held-out pairs preferring the chosen: {first:.3f} -> {last:.3f}")
    assert first < 0.6 and last > 0.65, evals


def test_lora_adapts_the_language_part_and_leaves_the_vision_tower(tiny_vlm_path, tmp_path) -> None:
    """`proj` would also name the vision tower's attention output; the family keeps the
    adapters inside the language model. A step on digits trains them, and the merged
    checkpoint loads with `from_pretrained`, its vision tower as it was."""
    from transformers import AutoModelForImageTextToText

    from rollwire.trainer.pipelines.common import save_model
    from rollwire.trainer.pipelines.steps import SupervisedStep
    from tests.helpers.vision import digit_prompts

    config = RunConfig.model_validate(
        {"trainer": {"lora": {"rank": 4, "target_modules": ["q_proj", "proj"]}}}
    )
    learner = Learner(tiny_vlm_path, config.trainer, family_for(CAUSAL_LM, tiny_vlm_path, config))
    try:
        adapted = {n for n, p in learner.model.named_parameters() if p.requires_grad}
        assert adapted and all("lora_" in n and ".language_model." in n for n in adapted)
        assert any(n.endswith(".q_proj.lora_A.default.weight") for n in adapted)
        prompts = digit_prompts(tiny_vlm_path, 4)
        sequences = [([*ids, 7, 8], [0] * len(ids) + [1, 1]) for ids, _ in prompts]
        metrics = SupervisedStep(learner).step(sequences, images=[i for _, i in prompts])
        assert metrics["loss"] > 0
        folder = save_model(learner, tmp_path / "merged", 1)
    finally:
        learner.close()
    merged = AutoModelForImageTextToText.from_pretrained(folder).state_dict()
    start = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path).state_dict()
    moved = {n for n in start if not torch.equal(merged[n], start[n])}
    assert moved and all(n.endswith("q_proj.weight") and "language_model" in n for n in moved)
