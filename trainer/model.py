"""The trained model: one trainer step on a batch of trajectories, and checkpoints.

Runs on a worker thread of the trainer process; knows nothing of gRPC or ZeroMQ.
Batches become tensors in `rollwire.trainer.batching`; the forward and backward
passes of a step are `rollwire.trainer.update`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwire.services.core.config import LoraConfig, RLSection, TrainerConfig
from rollwire.services.core.files import staged_directory
from rollwire.services.core.timing import PhaseClock
from rollwire.services.core.wire import Trajectory
from rollwire.trainer.advantages import Advantages
from rollwire.trainer.algorithms import RunningMoments, final_token_rewards, lr_factor
from rollwire.trainer.backends import (
    LocalBackend,
    TrainBackend,
    adamw_settings,
    backend_for,
    shutdown_process_group,
    split_by_tokens,
)
from rollwire.trainer.batching import (
    TokenBatch,
    collate,
    per_token_advantages,
    split_rows,
)
from rollwire.trainer.critic import Critic
from rollwire.trainer.pipeline_steps import PipelineSteps
from rollwire.trainer.update import Observed, Updater, average

log = logging.getLogger(__name__)

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


class Policy(Advantages, PipelineSteps):
    """The model being trained, its optimizer, and (when a KL penalty is on) a frozen reference.

    With trainer.lora the model is a peft model whose adapters alone train; the
    reference is then that model with its adapters off."""

    def __init__(self, model_path: str | Path, config: TrainerConfig, rl: RLSection) -> None:
        from rollwire.services.core.tiny import quiet_transformers

        quiet_transformers()
        torch.set_num_threads(config.threads)
        self.threads = config.threads
        self.config, self.rl = config, rl
        self.model_path = Path(model_path)
        if config.backend == "local":
            # float32 whatever trainer.precision says: these are the master weights. With
            # LoRA only the adapters require grad: the optimizer holds just them.
            lora = config.lora
            self.backend: TrainBackend = LocalBackend(
                self.model_path,
                adamw_settings(config),
                config.device,
                config.gradient_checkpointing,
                wrap=None if lora is None else lambda model: _with_adapters(model, lora),
            )
        else:
            self.backend = backend_for(config, self.model_path, config.distributed)
        self.model = self.backend.module
        self.optimizer = self.backend.optimizer
        self.device = self.backend.device
        self.pad_token_id = int(self.backend.hf_config.pad_token_id or 0)
        self.optimizer_steps = 0
        """Optimizer updates made so far in the run: the LR schedule's position."""
        self.reference: Any = None
        if config.kl.coef > 0 and config.lora is not None:
            # The base model is the reference: the same weights, adapters off.
            self.reference = AdaptersOff(self.model)
        elif config.kl.coef > 0:
            from transformers import AutoModelForCausalLM

            # Frozen, so no master copy is needed: under bf16 it is held in bf16.
            dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
            self.reference = (
                AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
                .to(self.device)
                .eval()
            )
            self.reference.requires_grad_(False)
        self.updater = Updater(self.model, self.reference, config, rl.temperature, self.device)
        self.reward_moments = RunningMoments()
        """Every reward trained on so far (trainer.reward_normalization: running)."""
        self.critic: Critic | None = None
        """`advantage: gae`: the value model, on the same backend and ranks."""
        if config.advantage.type == "gae":
            self.critic = Critic(config.advantage, config, self.model_path)
        self.update_metrics: list[dict[str, float]] = []
        """The loss metrics of each optimizer update of the last step, in order."""
        self._published: list[tuple[str, torch.Tensor]] = []
        """Sharded backends: rank 0's copy (CPU) of the full weights of the last step."""
        self.last_command = time.monotonic()
        if self.sharded:
            self._gather()

    @property
    def sharded(self) -> bool:
        """A multi-process backend (`fsdp2`, `deepspeed`), even on one rank."""
        return self.backend.name != "local"

    @property
    def rank(self) -> int:
        return self.backend.rank

    # ------------------------------------------------------------ ranks in step
    #
    # With several ranks, rank 0 runs the trainer loop and the others follow: each
    # collective method, called on rank 0, first tells the others to call it too (a
    # broadcast of its name and arguments), then runs; `follow` is the other ranks'
    # loop. Only rank 0 talks to the buffer and the rollout-servers.

    def _lead(self, *command: Any) -> None:
        self.last_command = time.monotonic()
        if self.backend.world_size > 1:
            if not self.backend.is_main:
                raise RuntimeError("only rank 0 leads; the other ranks run Policy.follow")
            self.backend.broadcast_object(command)

    def follow(self) -> None:
        """The loop of every rank but 0: does what rank 0 asks until it says stop."""
        calls = {
            "step": self._train_step,
            "save": self._save_checkpoint,
            "restore": self._restore,
            "supervised": self._supervised,
            "preference": self._preference,
            "beat": lambda: None,
        }
        while True:
            kind, *args = self.backend.broadcast_object(None)
            if kind == "stop":
                return
            calls[kind](*args)

    def followed(self) -> bool:
        """On ranks other than 0: follows rank 0 until it stops, leaves the group, and
        returns True; on rank 0 returns False at once (it leads: the caller's work)."""
        if self.backend.is_main:
            return False
        try:
            self.follow()
        finally:
            self.close()
        return True

    def heartbeat(self, every_seconds: float | None = None) -> None:
        """Rank 0, while it waits: tells the other ranks it lives, at most every
        `every_seconds` (a quarter of the collective timeout by default), so their
        wait for its next command never reaches that timeout."""
        if self.backend.world_size == 1:
            return
        every = every_seconds or self.config.distributed.timeout_seconds / 4
        if time.monotonic() - self.last_command >= every:
            self._lead("beat")

    def close(self) -> None:
        """Rank 0: lets the other ranks go; every rank: leaves the process group."""
        if self.backend.is_main:
            try:
                self._lead("stop")
            except RuntimeError as error:  # a rank is gone already: torchrun ends the rest
                log.warning("could not tell the other ranks to stop: %s", error)
        if self.critic is not None:
            self.critic.close()
        self.backend.close()
        if self.sharded:
            shutdown_process_group()

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
            schedule.decay_from,
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
        (one policy version); returns metrics, the loss ones averaged over the updates.

        Over several ranks each minibatch is split by tokens (`split_by_tokens`), every
        rank runs as many passes as the busiest (padding passes carry no tokens), and the
        metrics are those of the whole batch."""
        if torch.get_num_threads() != self.threads:  # per thread: set in the one that computes
            torch.set_num_threads(self.threads)
        self._lead("step", trajectories, trainer_version)
        return self._train_step(trajectories, trainer_version)

    def set_threads(self, threads: int) -> str | None:
        """Computes with `threads` CPU threads from the next step on: None, or why it cannot
        (ranks of other processes keep the threads they started with)."""
        if self.config.backend != "local":
            return f"the {self.config.backend} backend's ranks keep the threads they started with"
        self.threads = threads
        return None

    def _train_step(self, trajectories: list[Trajectory], trainer_version: int) -> dict[str, float]:
        started = time.perf_counter()
        scored = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        rewards, truncated, metrics = self._shaped_rewards(trajectories, scored)
        if self.token_level:
            # Advantages per token, per part: below (on top of the task's, when distilling).
            advantages, per_turn = self._distill_task_advantages(rewards), None
            keep = list(range(len(trajectories)))
        else:
            advantages, per_turn = self.advantages(trajectories, rewards)
            # Sequences with zero advantage carry no gradient: leave them out entirely.
            keep = [
                i
                for i in range(len(trajectories))
                if float(advantages[i]) != 0.0
                or (per_turn is not None and bool(per_turn[i].abs().sum() > 0))
            ]
        if self.config.overlong.mask_truncated:
            # DAPO's overlong filtering: in the group's statistics, out of the loss.
            keep = [i for i in keep if not truncated[i]]
        metrics |= {
            "reward_mean": float(scored.mean()),
            "reward_std": float(scored.std(unbiased=False)),
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
        if self.token_level and not self.distilling:
            batch.token_rewards = final_token_rewards(
                self._sequence_rewards(rewards)[keep], batch.mask
            )
        minibatches = [
            batch if len(rows) == len(keep) else batch.select(rows)
            for rows in split_rows(len(keep), self.config.minibatches_per_step)
        ]
        # The micro-batches are cut once and reused by every epoch.
        plan = self._plan(minibatches)
        totals = [self.updater.denominator(minibatch) for minibatch in minibatches]
        # One update per step: its weights are the proximal ones, and its own forward
        # gives their logprobs (no extra pass). More: the weights move after the first
        # update, so the proximal logprobs must be taken before it; so must a KL that
        # goes into the rewards.
        ahead = (
            len(plan) * self.config.epochs_per_step > 1
            or self.config.kl.in_reward
            or self.distilling
        )
        observed: list[Observed] = []
        parts = [part for minibatch_parts in plan for part in minibatch_parts]
        clock = PhaseClock()
        if ahead:
            with clock.phase("proximal"):
                observed.append(self.updater.proximal_pass(parts, trainer_version))
        if self.token_level:
            metrics.update(self._token_advantages(parts))
        backend = self.backend
        for _ in range(self.config.epochs_per_step):
            for parts, total in zip(plan, totals, strict=True):
                backend.zero_grad()
                with clock.phase("forward_backward"):
                    rows, shares, seen = self.updater.accumulate(
                        parts,
                        trainer_version,
                        observe=not ahead,
                        total=total,
                        ranks=backend.world_size,
                        backward=backend.backward,
                    )
                if seen is not None:
                    observed.append(seen)
                learning_rate = self.learning_rate()
                backend.set_lr(learning_rate)
                with clock.phase("optimizer"):
                    grad_norm = backend.clip_and_step(self.config.max_grad_norm)
                self.optimizer_steps += 1
                # Every rank's parts: the minibatch's token means.
                everyone = backend.all_gather_object((rows, shares))
                out = average(
                    [row for rank_rows, _ in everyone for row in rank_rows],
                    [share for _, rank_shares in everyone for share in rank_shares],
                )
                out.update(grad_norm=float(grad_norm), learning_rate=learning_rate)
                self.update_metrics.append(out)
        metrics.update(average(self.update_metrics))
        if self.critic is not None:
            factor = self.learning_rate() / self.config.learning_rate
            tokens = [minibatch.tokens for minibatch in minibatches]
            with clock.phase("critic"):
                metrics.update(self.critic.update(plan, tokens, factor))
        seen_by_all = [part for parts in backend.all_gather_object(observed) for part in parts]
        metrics.update(Observed.merged(seen_by_all).metrics())
        metrics.update(
            optimizer_steps=float(len(self.update_metrics)),
            step_seconds=time.perf_counter() - started,
        )
        if self.sharded:
            with clock.phase("gather"):
                self._gather()
        metrics.update(clock.times())
        return metrics

    def _plan(self, minibatches: list[TokenBatch]) -> list[list[TokenBatch]]:
        """This rank's micro-batches of each minibatch. Over several ranks each minibatch's
        sequences are split by tokens, and a rank with fewer passes than the busiest gets
        padding passes (one sequence, no generated tokens): on `fsdp2` and ZeRO-3 every
        forward gathers parameters, so every rank must run the same number."""
        world, rank = self.backend.world_size, self.backend.rank
        if world == 1:
            return [self.updater.parts(minibatch) for minibatch in minibatches]
        plan = []
        for minibatch in minibatches:
            rows = split_by_tokens(minibatch.lengths, world)[rank]
            plan.append(self.updater.parts(minibatch.select(rows)) if rows else [])
        counts = self.backend.reduce_metrics(
            {f"{i:06d}": float(len(parts)) for i, parts in enumerate(plan)}, "max"
        )
        for i, (parts, minibatch) in enumerate(zip(plan, minibatches, strict=True)):
            while len(parts) < int(counts[f"{i:06d}"]):
                padding = minibatch.select([0])
                padding.mask = torch.zeros_like(padding.mask)
                parts.append(padding)
        return plan

    def weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """`named_weights` that the next step cannot change: a copy of every tensor that is
        a live parameter (a full-weight local model); a sharded backend's gathered copy
        and LoRA's merged (or frozen) weights are new or unchanging already."""
        named = self.named_weights()
        if self.sharded or self.config.lora is not None:
            return named
        with torch.no_grad():
            return [(name, tensor.clone()) for name, tensor in named]

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters to publish, by the names a freshly loaded model uses: the float32
        master weights under either precision (a rollout-server casts them to the dtype
        it serves in). With LoRA, each target layer's weight is merged (W + scale B A)
        into a new tensor; the model keeps its adapters apart and trains on. On a
        sharded backend: rank 0's copy, gathered at the end of the last step (not
        collective; the other ranks have none)."""
        if self.sharded:
            return list(self._published)
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

    def _gather(self) -> None:
        """Sharded backends, every rank: gathers the full weights bucket by bucket (the
        device holds one bucket at a time); rank 0 keeps a CPU copy to publish, and to
        catch restarted rollout-servers up without asking the other ranks."""
        published = []
        for name, tensor in self.backend.iter_full_weights():
            if self.backend.is_main:
                published.append((name, tensor.detach().to("cpu", copy=True)))
        self._published = published

    def save_checkpoint(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Writes a Hugging Face model folder plus optimizer and LR-schedule state (and
        `extra`), atomically. With LoRA the folder's model is the merged one and the
        adapters are in its `adapter/` (peft's `save_pretrained`). On a sharded backend
        the folder's model is consolidated from the shards and the sharded state (for
        an exact resume on any backend built the same way) is in its `backend/`. With a
        critic (`advantage: gae`), its weights and optimizer are in `critic/`."""
        self._lead("save", str(folder), step, version, extra)
        return self._save_checkpoint(folder, step, version, extra)

    def _trainer_state(self, step: int, version: int, extra: dict[str, Any] | None) -> dict:
        return {
            "lr_schedule": {"optimizer_steps": self.optimizer_steps},
            "reward_moments": self.reward_moments.state_dict(),
            "step": step,
            "policy_version": version,
            "rng": torch.get_rng_state(),
            **(extra or {}),
        }

    def _save_checkpoint(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Path:
        from transformers import AutoTokenizer

        folder = Path(folder)
        if self.sharded:
            # Every rank writes into one staging folder, renamed once complete.
            staging = folder.with_name(f".{folder.name}.partial")
            self.backend.save_pretrained(staging)
            self.backend.save(staging / "backend")
            if self.critic is not None:
                self.critic.save(staging / "critic")
            if self.backend.is_main:
                state = self._trainer_state(step, version, extra)
                state["backend"] = self.backend.name
                torch.save(state, staging / "trainer_state.pt")
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(staging, folder)
            self.backend.barrier()
            return folder
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
            if self.critic is not None:
                self.critic.save(staging / "critic")
            state = {
                "optimizer": self.optimizer.state_dict(),
                **self._trainer_state(step, version, extra),
            }
            torch.save(state, staging / "trainer_state.pt")
        return folder

    def restore(self, folder: str | Path) -> dict[str, Any]:
        """Loads the weights, optimizer and LR-schedule state of a `save_checkpoint`
        folder; returns its trainer state (step, policy_version and what the caller
        saved with it)."""
        self._lead("restore", str(folder))
        return self._restore(folder)

    def _restore(self, folder: str | Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        saved_backend = state.get("backend", "local")
        if saved_backend != self.backend.name:
            raise ValueError(
                f"{folder}: a checkpoint of trainer.backend={saved_backend}, but this run's "
                f"is {self.backend.name}; its Hugging Face folder can start a new run "
                "(trainer.model_path) instead"
            )
        if self.critic is not None:
            self.critic.load(folder / "critic")
        if "reward_moments" in state:
            self.reward_moments.load_state_dict(state["reward_moments"])
        if self.sharded:
            self.backend.load(folder / "backend")
            self.optimizer_steps = int(state["lr_schedule"]["optimizer_steps"])
            if "rng" in state:
                torch.set_rng_state(state["rng"])
            self._gather()
            return state
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
