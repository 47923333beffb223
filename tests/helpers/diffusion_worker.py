"""One rank of the diffusion-family checks in tests/trainer/test_diffusion_backends.py
(run directly for `local`, under torchrun for the others): two Flow-GRPO steps and two
reward feedback learning steps on the same learner, fixed trajectories, then the
consolidated diffusers folder.

Rank 0 drives both steps as the trainer process does; the other ranks `follow` it.
Eight samples in three minibatches (3, 3, 2 rows: the ranks get unequal shares) and two
epochs (no KL: a frozen reference runs on the local backend only, for every family).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from rollwire.diffusion.data import ANY
from rollwire.diffusion.digits import velocity
from rollwire.diffusion.sampling import SamplingSettings, sample
from rollwire.diffusion.trajectories import latent_trajectory, scoring_tensor
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.services.core.config.distributed import DeepSpeedConfig, DistributedConfig
from rollwire.trainer.models.flow_denoiser import FlowDenoiser
from rollwire.trainer.rl.flow_grpo import FlowGRPOStep
from rollwire.trainer.rl.policy import Policy
from rollwire.trainer.rl.reward_fl import RewardFLStep

SDE = SamplingSettings(steps=6, eta=0.8, sde_window=(1, 5))
ODE = SamplingSettings(steps=6, eta=0.0, sde_window=(4, 6))
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.7, 0.1]
COMPARED = ("loss", "grad_norm", "optimizer_steps", "learning_rate")


def trajectories(model: Path, settings: SamplingSettings) -> list:
    from diffusers import UNet2DModel

    unet = UNet2DModel.from_pretrained(model).eval()
    labels = torch.full((len(REWARDS),), ANY)
    drawn = sample(
        lambda x, t, y: velocity(unet, x, t, y), labels, list(range(len(REWARDS))), settings
    )
    out = []
    for i, reward in enumerate(REWARDS):
        row = SimpleNamespace(
            recorded_steps=drawn.recorded_steps,
            logprobs=drawn.logprobs[i].tolist(),
            policy_versions=[0] * len(drawn.recorded_steps),
            label=ANY,
            latents=drawn.latents[i].numpy(),
        )
        out.append(
            latent_trajectory(
                row,
                trajectory_id=f"t{i}",
                group_id=f"g{i // 4}",
                sample_index=i % 4,
                prompt_ordinal=i // 4,
                task_id="any",
                source="digits",
                domain="brightness",
                settings=settings,
                reward=reward,
                scoring=scoring_tensor("", {}),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["local", "fsdp2", "deepspeed"], required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = TrainerConfig(
        backend=args.backend,
        optimizer={"learning_rate": 1e-4, "max_grad_norm": 0.5},
        batching={"minibatches_per_step": 3, "epochs_per_step": 2},
        distributed=DistributedConfig(
            timeout_seconds=120, deepspeed=DeepSpeedConfig(zero_stage=args.zero_stage)
        ),
    )
    rl = RLSection(group_size=4, max_steps=4)
    policy = Policy(args.model, config, rl, FlowDenoiser(), FlowGRPOStep)
    reward_fl = RewardFLStep(policy.learner, config, rl)
    if policy.followed():  # ranks other than 0 did what rank 0 asked
        return
    from safetensors.torch import save_file

    out = args.out
    results: dict = {"world_size": policy.learner.backend.world_size}
    try:
        sde, ode = trajectories(args.model, SDE), trajectories(args.model, ODE)
        for version in (0, 1):
            metrics = policy.train_step(sde, version)
            results[f"flow_grpo{version}"] = {k: metrics[k] for k in (*COMPARED, "ratio_mean")}
            results[f"flow_grpo{version}"]["mismatch"] = metrics.get("mismatch_abs_max")
        save_file(dict(policy.named_weights()), str(out / "flow_grpo.safetensors"))
        for version in (2, 3):
            metrics = reward_fl.train_step(ode, version)
            results[f"reward_fl{version}"] = {k: metrics[k] for k in (*COMPARED, "fl_reward")}
        save_file(dict(policy.named_weights()), str(out / "reward_fl.safetensors"))
        policy.save_checkpoint(out / "checkpoint", 4, 4)
        (out / "results.json").write_text(json.dumps(results))
    finally:
        policy.close()


if __name__ == "__main__":
    main()
