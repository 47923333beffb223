"""One rank of the trainer-step checks in tests/trainer/test_backends.py (run directly for `local`,
under torchrun for the others): `Policy.train_step` on two fixed groups, then a
checkpoint, another step, and (`--phase resume`) the same step after a restore.
`--advantage gae` adds the critic (a second model on the same ranks) to all of it.

Rank 0 drives the `Policy` as the trainer process does; the other ranks `follow` it.
Three minibatches of 3, 3 and 2 sequences, one sequence a micro-batch, two epochs:
the ranks get different numbers of micro-batches (padding passes) and the clip acts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from trajectories import group

from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.config.distributed import DeepSpeedConfig, DistributedConfig
from rollwire.trainer.rl.policy import Policy

COMPARED = (
    "loss",
    "grad_norm",
    "entropy_mean",
    "ratio_mean",
    "ratio_max",
    "clip_frac_high",
    "optimizer_steps",
    "learning_rate",
)
CRITIC = ("critic_loss", "critic_value_mean", "critic_explained_variance", "critic_grad_norm")
"""Compared too under `--advantage gae`."""


def batch(version: int) -> list:
    """Two groups of four; rewards differ, so every sequence carries signal."""
    first = group([1.0, 0.0, 1.0, 0.0], version)
    second = [
        dataclasses.replace(t, trajectory_id=f"u{i}", task_id="h", prompt_ordinal=1)
        for i, t in enumerate(group([0.0, 1.0, 1.0, 0.0], version))
    ]
    return first + second


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["local", "fsdp2", "deepspeed"], required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["train", "resume"], default="train")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--advantage", choices=["grpo", "gae"], default="grpo")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = TrainerConfig(
        backend=args.backend,
        device=args.device,
        learning_rate=1e-3,
        max_grad_norm=0.5,
        minibatches_per_step=3,
        epochs_per_step=2,
        micro_batch_size=1,
        advantage={"type": args.advantage},
        distributed=DistributedConfig(
            timeout_seconds=120, deepspeed=DeepSpeedConfig(zero_stage=args.zero_stage)
        ),
    )
    policy = Policy(args.model, config, RLSection(group_size=4, max_steps=4))
    if policy.followed():  # ranks other than 0 did what rank 0 asked
        return
    from safetensors.torch import save_file

    out, results = args.out, {"world_size": policy.learner.backend.world_size}
    compared = COMPARED + (CRITIC if args.advantage == "gae" else ())
    try:
        if args.phase == "train":
            first = policy.train_step(batch(0), 0)
            results["step1"] = {key: first[key] for key in compared}
            save_file(dict(policy.named_weights()), str(out / "policy1.safetensors"))
            policy.save_checkpoint(out / "policy_checkpoint", 1, 1, {"uncommitted_ids": ["t0"]})
        else:
            saved = policy.restore(out / "policy_checkpoint")
            results["restored"] = [saved["step"], saved["policy_version"], saved["uncommitted_ids"]]
            save_file(dict(policy.named_weights()), str(out / "restored1.safetensors"))
        second = policy.train_step(batch(1), 1)
        results["step2"] = {key: second[key] for key in compared}
        save_file(dict(policy.named_weights()), str(out / f"{args.phase}2.safetensors"))
        (out / f"policy_{args.phase}.json").write_text(json.dumps(results))
    finally:
        policy.close()


if __name__ == "__main__":
    main()
