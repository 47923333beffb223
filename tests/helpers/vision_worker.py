"""Two training steps of the tiny vision-language model on a batch of its own per rank
(rank 0's rows show digits, rank 1's are text), or, with one process, the same loss as
the mean of the two ranks' (`--local`). Writes each step's loss and gradient norm, and
the model as a Hugging Face folder to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.helpers


def _batch(model: Path, with_images: bool):
    from transformers import AutoTokenizer

    from rollwire.services.core.vision import VisionSide
    from rollwire.trainer.batching import collate
    from tests.helpers.trajectories import sequence
    from tests.helpers.vision import digit_images

    side, tokenizer = VisionSide(model), AutoTokenizer.from_pretrained(model)
    rows = []
    for i, (image, label) in enumerate(digit_images(3, first=10 if with_images else 20)):
        prompt, placed = side.prompt_ids(
            [image] if with_images else [], tokenizer("Digit? ")["input_ids"]
        )
        answer = tokenizer(f"{label}{' ' * i}")["input_ids"] + [tokenizer.eos_token_id]
        rows.append(sequence(prompt, answer, images=placed, reward=1.0, index=i))
    return collate(rows, 0)


def _loss(family, module, batch, device) -> torch.Tensor:
    logits = family.logits(module, batch, device).float()
    chosen = torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]
    return -(chosen * batch.mask).sum() / batch.mask.sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--zero-stage", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rollwire.services.core.config import RunConfig
    from rollwire.trainer.learner import Learner
    from rollwire.trainer.models import family_for
    from rollwire.trainer.pipelines.table import CAUSAL_LM

    trainer = {"backend": args.backend, "freeze": ["model.visual.patch_embed"]}
    if args.backend == "deepspeed":
        trainer["distributed"] = {"deepspeed": {"zero_stage": args.zero_stage}}
    config = RunConfig.model_validate({"trainer": trainer})
    family = family_for(CAUSAL_LM, args.model, config)
    learner = Learner(args.model, config.trainer, family)
    batches = (
        [_batch(args.model, True), _batch(args.model, False)]
        if args.backend == "local"
        else [_batch(args.model, learner.rank == 0)]
    )
    steps = []
    for _ in range(2):
        parts = [_loss(family, learner.backend.module, b, learner.device) for b in batches]
        loss = sum(parts) / len(parts)
        learner.backend.backward(loss)
        steps.append({"norm": float(learner.backend.clip_and_step(100.0))})
    learner.backend.save_pretrained(args.out / "checkpoint")  # every rank: it gathers
    if learner.rank == 0:
        (args.out / "steps.json").write_text(json.dumps(steps))
    learner.backend.barrier()
    learner.backend.close()


if __name__ == "__main__":
    main()
