"""The trained model: one trainer step on a batch of trajectories, and checkpoints.

Runs on a worker thread of the trainer process; knows nothing of gRPC or ZeroMQ.
Batches become tensors in `rollwire.trainer.batching`; the forward and backward
passes of a step are `rollwire.trainer.update`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import LoraConfig, RLSection, TrainerConfig
from rollwire.services.core.files import staged_directory
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.algorithms import group_advantages, lr_factor, step_advantages
from rollwire.trainer.batching import TokenBatch, collate, per_token_advantages, split_rows
from rollwire.trainer.update import Updater, average

__all__ = ["AdaptersOff", "Policy", "TokenBatch", "collate", "per_token_advantages"]

ADAPTER = "default"
"""The name peft gives the one adapter `Policy` trains."""


def _with_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters (all other weights frozen)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    peft_config = PeftLoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
    )
    return get_peft_model(model, peft_config, adapter_name=ADAPTER)


class AdaptersOff:
    """Calls a peft model with its adapters switched off: the base model, for the KL
    reference, without a second copy of its weights."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, **inputs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(**inputs)


class Policy:
    """The model being trained, its optimizer, and (when a KL penalty is on) a frozen reference.

    With trainer.lora the model is a peft model whose adapters alone train; the
    reference is then that model with its adapters off."""

    def __init__(self, model_path: str | Path, config: TrainerConfig, rl: RLSection) -> None:
        from transformers import AutoModelForCausalLM

        from rollwire.services.core.tiny import quiet_transformers

        quiet_transformers()
        torch.set_num_threads(config.threads)
        self.config, self.rl = config, rl
        self.model_path = Path(model_path)
        self.device = torch.device(config.device)
        # float32 whatever trainer.precision says: these are the master weights.
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(
            self.device
        )
        if config.gradient_checkpointing:
            # Non-reentrant: no need for inputs that require grad, and exact gradients.
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if config.lora is not None:
            self.model = _with_adapters(self.model, config.lora)
        self.model.train()
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        # With LoRA only the adapters require grad: the optimizer holds just them.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            betas=config.adam_betas,
            eps=config.adam_eps,
        )
        self.optimizer_steps = 0
        """Optimizer updates made so far in the run: the LR schedule's position."""
        self.reference: Any = None
        if config.loss.kl_coef > 0 and config.lora is not None:
            # The base model is the reference: the same weights, adapters off.
            self.reference = AdaptersOff(self.model)
        elif config.loss.kl_coef > 0:
            # Frozen, so no master copy is needed: under bf16 it is held in bf16.
            dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
            self.reference = (
                AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
                .to(self.device)
                .eval()
            )
            self.reference.requires_grad_(False)
        self.updater = Updater(self.model, self.reference, config, rl.temperature, self.device)
        self.update_metrics: list[dict[str, float]] = []
        """The loss metrics of each optimizer update of the last step, in order."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step makes when every minibatch has sequences."""
        return self.config.minibatches_per_step * self.config.epochs_per_step

    def learning_rate(self) -> float:
        """The rate the next optimizer update runs at (trainer.lr_schedule)."""
        schedule = self.config.lr_schedule
        total = self.rl.max_steps * self.updates_per_step
        factor = lr_factor(
            self.optimizer_steps,
            total,
            schedule.type,
            schedule.warmup_steps,
            schedule.min_lr_ratio,
        )
        return self.config.learning_rate * factor

    def _logprobs(self, model: torch.nn.Module, batch: TokenBatch, rows: slice) -> torch.Tensor:
        """[rows, T-1] logprobs of `batch`'s targets, at full width (for tests and tools)."""
        part = dataclasses.replace(
            batch,
            input_ids=batch.input_ids[rows],
            attention=batch.attention[rows],
            targets=batch.targets[rows],
        )
        return self.updater.logprobs(model, part)

    def train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        """One trainer step on whole groups: epochs_per_step x minibatches_per_step
        optimizer updates against the proximal logprobs of the weights it started from
        (one policy version); returns metrics, the loss ones averaged over the updates."""
        started = time.perf_counter()
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = group_advantages(
            rewards, self.rl.group_size, scale=self.config.loss.scale_advantages
        )
        per_turn: list[torch.Tensor] | None = None
        if self.config.loss.advantage == "step":
            per_turn = step_advantages(
                advantages,
                [t.turn_keys for t in trajectories],
                [t.step_rewards.tolist() for t in trajectories],
                self.rl.group_size,
                gamma=self.config.loss.gamma,
                weight=self.config.loss.step_advantage_weight,
                scale=self.config.loss.scale_advantages,
            )
        # Sequences with zero advantage carry no gradient: leave them out entirely.
        keep = [
            i
            for i in range(len(trajectories))
            if float(advantages[i]) != 0.0
            or (per_turn is not None and bool(per_turn[i].abs().sum() > 0))
        ]
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "sequences": float(len(trajectories)),
            "sequences_with_signal": float(len(keep)),
        }
        if per_turn is not None:
            step_parts = [turns - advantages[i] for i, turns in enumerate(per_turn)]
            nonempty = [part for part in step_parts if part.numel()]
            metrics["step_advantage_abs_mean"] = (
                float(torch.cat(nonempty).abs().mean()) if nonempty else 0.0
            )
        generated = np.concatenate([t.policy_versions[t.loss_mask == 1] for t in trajectories])
        if generated.size:
            metrics["staleness_mean"] = float(trainer_version - generated.mean())
            metrics["staleness_max"] = float(trainer_version - generated.min())
        metrics["response_tokens_mean"] = float(generated.size / len(trajectories))
        self.update_metrics = []
        if not keep:
            metrics.update(
                loss=0.0,
                grad_norm=0.0,
                optimizer_steps=0.0,
                learning_rate=self.learning_rate(),
                step_seconds=time.perf_counter() - started,
            )
            return metrics
        kept = [trajectories[i] for i in keep]
        batch = collate(kept, self.pad_token_id)
        batch.advantages = per_token_advantages(
            kept,
            advantages[keep],
            None if per_turn is None else [per_turn[i] for i in keep],
            batch.mask.shape[1],
        )
        minibatches = [
            batch if len(rows) == len(keep) else batch.select(rows)
            for rows in split_rows(len(keep), self.config.minibatches_per_step)
        ]
        # The micro-batches are cut once and reused by every epoch.
        plan = [self.updater.parts(minibatch) for minibatch in minibatches]
        # One update per step: its weights are the proximal ones, and its own forward
        # gives their logprobs (no extra pass). More: the weights move after the first
        # update, so the proximal logprobs must be taken before it.
        ahead = len(plan) * self.config.epochs_per_step > 1
        observed: dict[str, float] = {}
        if ahead:
            observed = self.updater.proximal_pass(
                [part for parts in plan for part in parts], trainer_version
            )
        for _ in range(self.config.epochs_per_step):
            for parts in plan:
                self.optimizer.zero_grad(set_to_none=True)
                out, seen = self.updater.accumulate(parts, trainer_version, observe=not ahead)
                observed.update(seen)
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.trainable, self.config.max_grad_norm
                )
                learning_rate = self.learning_rate()
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
                self.optimizer.step()
                self.optimizer_steps += 1
                out.update(grad_norm=float(grad_norm), learning_rate=learning_rate)
                self.update_metrics.append(out)
        metrics.update(average(self.update_metrics))
        metrics.update(observed)
        metrics.update(
            optimizer_steps=float(len(self.update_metrics)),
            step_seconds=time.perf_counter() - started,
        )
        return metrics

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters to publish, by the names a freshly loaded model uses: the float32
        master weights under either precision (a rollout-server casts them to the dtype
        it serves in). With LoRA, each target layer's weight is merged (W + scale B A)
        into a new tensor; the model keeps its adapters apart and trains on."""
        if self.config.lora is None:
            return [(name, p.detach()) for name, p in self.model.named_parameters()]
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        out = []
        with torch.no_grad():
            for name, p in base.named_parameters():
                owner, _, leaf = name.rpartition(".")
                if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
                    owner = owner[: -len(".base_layer")]
                    tensor = p.detach()
                    if leaf == "weight":
                        tensor = tensor + layers[owner].get_delta_weight(ADAPTER)
                    out.append((f"{owner}.{leaf}", tensor))
                elif not any(part.startswith("lora_") for part in owner.split(".")):
                    out.append((name, p.detach()))
        return out

    def save_checkpoint(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Writes a Hugging Face model folder plus optimizer and LR-schedule state (and
        `extra`), atomically. With LoRA the folder's model is the merged one and the
        adapters are in its `adapter/` (peft's `save_pretrained`)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        with staged_directory(folder) as staging:
            if self.config.lora is None:
                self.model.save_pretrained(staging)
            else:
                self.model.save_pretrained(staging / "adapter")
                # The plain model's config and names, the merged weights.
                self.model.get_base_model().save_pretrained(
                    staging, state_dict=dict(self.named_weights())
                )
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(staging)
            state = {
                "optimizer": self.optimizer.state_dict(),
                "lr_schedule": {"optimizer_steps": self.optimizer_steps},
                "step": step,
                "policy_version": version,
                "rng": torch.get_rng_state(),
                **(extra or {}),
            }
            torch.save(state, staging / "trainer_state.pt")
        return folder

    def restore(self, folder: str | Path) -> dict[str, Any]:
        """Loads the weights, optimizer and LR-schedule state of a `save_checkpoint`
        folder; returns its trainer state (step, policy_version and what the caller
        saved with it)."""
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        adapter = folder / "adapter"
        if adapter.is_dir() != (self.config.lora is not None):
            raise ValueError(
                f"{folder}: a checkpoint {'with' if adapter.is_dir() else 'without'} LoRA "
                f"adapters, but trainer.lora is {'unset' if self.config.lora is None else 'set'}"
            )
        if self.config.lora is not None:
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            weights = load_peft_weights(str(adapter), device=str(self.device))
            loaded = set_peft_model_state_dict(self.model, weights, adapter_name=ADAPTER)
            unexpected = getattr(loaded, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"{adapter}: weights this model has no place for: {unexpected}")
        else:
            saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            self.model.load_state_dict(saved.state_dict())
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        # The loaded groups carry the saved run's settings; this run's config decides
        # (the learning rate is set before every update anyway).
        for group in self.optimizer.param_groups:
            group.update(
                betas=self.config.adam_betas,
                eps=self.config.adam_eps,
                weight_decay=self.config.weight_decay,
            )
        # A checkpoint from before schedules made one update per step.
        schedule = state.get("lr_schedule", {"optimizer_steps": int(state["step"])})
        self.optimizer_steps = int(schedule["optimizer_steps"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        return state
