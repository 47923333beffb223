"""The learner: one trained model on its backend, knowing no model kind and no algorithm.

It owns the backend (`local`, `fsdp2`, `deepspeed`: trainer/backends/), the optimizer
and its learning-rate schedule, precision, LoRA, the global-norm clip, checkpoints and
their exact resume, the weights it publishes, and the ranks. What kind of model it is
(how it loads, its forward, what is saved beside it) is its `ModelFamily`
(trainer/models/); what a step computes is the step's (trainer/rl/step.py,
trainer/pipelines/steps.py), which takes the learner.

Ranks: with several, rank 0 runs the program and the others follow. A method marked
`@collective` (on the learner, or on a step attached to it with `Learner.attach`), when
rank 0 calls it, first sends its name and arguments to the others, which replay it
(`Learner.follow`); calls made inside one run on every rank already and are not sent
again. Only rank 0 talks to the buffer and the rollout-servers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from rollwire.rollout.server.weights import merge_adapter
from rollwire.services.core.config import LoraConfig, RunConfig, TrainerConfig
from rollwire.services.core.files import staging_folder
from rollwire.trainer.backends import (
    LocalBackend,
    TrainBackend,
    adamw_settings,
    backend_for,
    shutdown_process_group,
    split_by_tokens,
)
from rollwire.trainer.batching import TokenBatch
from rollwire.trainer.math.algorithms import lr_factor
from rollwire.trainer.models import CausalLM, ModelFamily

log = logging.getLogger(__name__)

__all__ = ["ADAPTER", "AdaptersOff", "Learner", "collective", "in_precision", "torchrun_argv"]

ADAPTER = "default"


def _plain_linear(layer: Any) -> bool:
    """A LoRA layer whose weight is base + scale * (B @ A) as `merge_adapter` computes it:
    a linear layer stored [out, in] (not a convolution, not fan_in_fan_out)."""
    return isinstance(layer.get_base_layer(), torch.nn.Linear) and not getattr(
        layer, "fan_in_fan_out", False
    )


"""The name peft gives the one adapter a learner trains."""

Method = TypeVar("Method", bound=Callable[..., Any])


def collective(method: Method) -> Method:
    """Marks a method of a `Learner`, or of a party attached to one, as run by every
    rank: called on rank 0 it tells the other ranks to run it too, with the same
    arguments, then runs (see the module docstring)."""

    @functools.wraps(method)
    def lead(owner: Any, *args: Any, **kwargs: Any) -> Any:
        learner = owner if isinstance(owner, Learner) else owner.learner
        return learner.lead(owner, method, args, kwargs)

    lead.collective = method  # type: ignore[attr-defined]  # what the other ranks replay
    return lead  # type: ignore[return-value]


def torchrun_argv(config: RunConfig, argv: list[str], command: str = "trainer") -> list[str]:
    """The command that runs `rollwire COMMAND ARGV` as trainer.world_size ranks: torchrun
    with a rendezvous of its own on this machine (a free port), or this machine's share of
    the ranks when `ROLLWIRE_TRAINER_NODES` places them on several; no restarts of single
    ranks: one that dies takes the group down, and whoever runs the trainer (the
    `rollwire train` launcher) starts it again from its last checkpoint."""
    from rollwire.services.core.server import TRAINER_NODES_ENV

    world = config.trainer.world_size
    placement = ["--standalone", "--nproc-per-node", str(world)]
    if os.environ.get(TRAINER_NODES_ENV):  # the config checked that `nodes` divides `world`
        nodes, node_rank, master = os.environ[TRAINER_NODES_ENV].split(",")
        host, _, port = master.rpartition(":")
        placement = [
            *("--nnodes", nodes, "--node-rank", node_rank),
            *("--master-addr", host, "--master-port", port),
            *("--nproc-per-node", str(world // int(nodes))),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *placement,
        "--max-restarts",
        "0",
        "-m",
        "rollwire.services.app.cli",
        command,
        *argv,
    ]


def in_precision(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """A forward's precision: under bf16, matmuls in bfloat16 on the float32 master
    weights; outside it (the loss, the optimizer) everything stays float32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _with_adapters(
    model: torch.nn.Module, lora: LoraConfig, task: str, within: str = ""
) -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters (all other weights frozen); `task` is the
    family's peft task type, empty for a model that is not a transformers one; `within`:
    a module prefix the adapters stay inside (the family's `lora_within`)."""
    import re

    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    targets: list[str] | str = list(lora.target_modules)
    if within:  # peft full-matches a string against each module's name
        suffixes = "|".join(re.escape(suffix) for suffix in lora.target_modules)
        targets = rf"{re.escape(within)}\.(?:.*\.)?(?:{suffixes})"
    peft_config = PeftLoraConfig(
        task_type=getattr(TaskType, task) if task else None,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
    )
    return get_peft_model(model, peft_config, adapter_name=ADAPTER)


class AdaptersOff:
    """Calls a peft model with its adapters switched off: the base model, for a frozen
    reference, without a second copy of its weights."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **inputs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(*args, **inputs)


class Learner:
    """The trained model, its optimizer and schedule, on one rank (see the module
    docstring). With trainer.lora the model is a peft model whose adapters alone train.

    `total_updates` is the schedule's length in optimizer updates (the step sets it)."""

    def __init__(
        self,
        model_path: str | Path,
        config: TrainerConfig,
        family: ModelFamily | None = None,
        total_updates: int = 1,
    ) -> None:
        from rollwire.services.core.tiny import quiet_transformers

        quiet_transformers()
        torch.set_num_threads(config.threads)
        self.threads = config.threads
        self.config = config
        self.family = family or CausalLM()
        self.family.ranks_in_step = config.backend != "local"
        self.family.share_prefix = config.batching.share_prefix
        self.model_path = Path(model_path)
        if config.backend == "local":
            # float32 whatever trainer.precision says: these are the master weights. With
            # LoRA only the adapters require grad: the optimizer holds just them.
            lora, task, within = config.lora, self.family.lora_task, self.family.lora_within
            self.backend: TrainBackend = LocalBackend(
                self.model_path,
                adamw_settings(config),
                config.device,
                config.gradient_checkpointing,
                wrap=None
                if lora is None
                else lambda model: _with_adapters(model, lora, task, within),
                family=self.family,
            )
        else:
            self.backend = backend_for(config, self.model_path, config.distributed, self.family)
        self.model = self.backend.module
        self.optimizer = self.backend.optimizer
        self.device = self.backend.device
        self.pad_token_id = self.family.pad_token_id(self.backend.hf_config)
        self.optimizer_steps = 0
        """Optimizer updates made so far in the run: the LR schedule's position."""
        self.total_updates = total_updates
        self._published: list[tuple[str, torch.Tensor]] = []
        """Sharded backends: rank 0's copy (CPU) of the full weights, gathered last."""
        self._parties: dict[str, Any] = {"learner": self}
        self._names: dict[int, str] = {id(self): "learner"}
        """Each party's name, by identity: what `lead` sends the other ranks."""
        self._replaying = False
        self.last_command = time.monotonic()
        if self.sharded:
            self.gather()

    # ------------------------------------------------------------------- ranks

    @property
    def sharded(self) -> bool:
        """A multi-process backend (`fsdp2`, `deepspeed`), even on one rank."""
        return self.backend.name != "local"

    @property
    def rank(self) -> int:
        return self.backend.rank

    def attach(self, party: Any, name: str) -> None:
        """Lets `party`'s `@collective` methods run on every rank (each rank attaches
        its own under the same `name`); a party with `save_state`/`load_state` saves
        into checkpoints and restores from them, one with `close` is closed with the
        learner."""
        if name in self._parties:
            raise ValueError(f"a party called {name!r} is attached already")
        self._parties[name] = party
        self._names[id(party)] = name

    def lead(self, owner: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs `method` of `owner` on every rank (what `@collective` calls)."""
        if self._replaying:  # inside a collective call: every rank is in it already
            return method(owner, *args, **kwargs)
        if torch.get_num_threads() != self.threads:  # per thread: set in the one computing
            torch.set_num_threads(self.threads)
        self._send((self._names[id(owner)], method.__name__, args, kwargs))
        self._replaying = True
        try:
            return method(owner, *args, **kwargs)
        finally:
            self._replaying = False

    def _send(self, command: tuple) -> None:
        self.last_command = time.monotonic()
        if self.backend.world_size > 1:
            if not self.backend.is_main:
                raise RuntimeError("only rank 0 leads; the other ranks run Learner.follow")
            self.backend.broadcast_object(command)

    def follow(self) -> None:
        """The loop of every rank but 0: does what rank 0 asks until it says stop."""
        while True:
            party, name, args, kwargs = self.backend.broadcast_object(None)
            if party is None:
                if name == "stop":
                    return
                continue  # a heartbeat
            owner = self._parties[party]
            self._replaying = True
            try:
                getattr(type(owner), name).collective(owner, *args, **kwargs)
            finally:
                self._replaying = False

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
            self._send((None, "beat", (), {}))

    def close(self) -> None:
        """Rank 0: lets the other ranks go; every rank: closes the parties and leaves
        the process group."""
        if self.backend.is_main:
            try:
                self._send((None, "stop", (), {}))
            except RuntimeError as error:  # a rank is gone already: torchrun ends the rest
                log.warning("could not tell the other ranks to stop: %s", error)
        for name, party in self._parties.items():
            if name != "learner" and hasattr(party, "close"):
                party.close()
        self.backend.close()
        if self.sharded:
            shutdown_process_group()

    def set_threads(self, threads: int) -> str | None:
        """Computes with `threads` CPU threads from the next step on: None, or why it cannot
        (ranks of other processes keep the threads they started with)."""
        if self.config.backend != "local":
            return f"the {self.config.backend} backend's ranks keep the threads they started with"
        self.threads = threads
        return None

    def plan(
        self, minibatches: list[TokenBatch], parts: Callable[[TokenBatch], list[TokenBatch]]
    ) -> list[list[TokenBatch]]:
        """This rank's micro-batches (`parts(minibatch)`) of each minibatch. Over several
        ranks each minibatch's sequences are split by tokens, and a rank with fewer
        passes than the busiest gets padding passes (one sequence, no loss tokens): on
        `fsdp2` and ZeRO-3 every forward gathers parameters, so every rank runs as many."""
        world, rank = self.backend.world_size, self.backend.rank
        if world == 1:
            return [parts(minibatch) for minibatch in minibatches]
        plan = []
        for minibatch in minibatches:
            rows = split_by_tokens(minibatch.lengths, world)[rank]
            plan.append(parts(minibatch.select(rows)) if rows else [])
        counts = self.backend.reduce_metrics(
            {f"{i:06d}": float(len(mine)) for i, mine in enumerate(plan)}, "max"
        )
        for i, (mine, minibatch) in enumerate(zip(plan, minibatches, strict=True)):
            while len(mine) < int(counts[f"{i:06d}"]):
                padding = minibatch.select([0])
                padding.mask = torch.zeros_like(padding.mask)
                mine.append(padding)
        return plan

    def pair_passes(self, lengths: list[int]) -> list[list[int]]:
        """This rank's passes over pairs of sequences (preference pairs) whose token counts
        are `lengths`: the pairs split over the ranks by tokens, micro_batch_size // 2 pairs
        a pass, and empty passes up to the busiest rank's count (on `fsdp2` and ZeRO-3 every
        forward is collective, so every rank runs as many)."""
        world = self.backend.world_size
        mine = (
            split_by_tokens(lengths, world)[self.rank] if world > 1 else list(range(len(lengths)))
        )
        size = max(1, self.config.batching.micro_batch_size // 2)
        passes = [mine[i : i + size] for i in range(0, len(mine), size)]
        most = int(self.backend.reduce_metrics({"passes": float(len(passes))}, "max")["passes"])
        return passes + [[] for _ in range(most - len(passes))]

    # ------------------------------------------------------- forward and update

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision (`in_precision`)."""
        return in_precision(self.config.precision, self.device)

    def forward(self, batch: Any, model: Any = None) -> torch.Tensor:
        """The family's forward of `model` (the trained one by default) on `batch`, in
        the configured precision."""
        with self.autocast():
            return self.family.logits(self.model if model is None else model, batch, self.device)

    def frozen_reference(self) -> Any:
        """The model as it starts, frozen (a KL's reference): with LoRA the trained
        model with its adapters off, else a copy (in bf16 under bf16: it needs no
        master weights)."""
        if self.config.lora is not None:
            return AdaptersOff(self.model)
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float32
        return self.family.load_frozen(self.model_path, dtype).to(self.device)

    def learning_rate(self) -> float:
        """The rate the next optimizer update runs at (trainer.schedule)."""
        schedule = self.config.schedule
        factor = lr_factor(
            self.optimizer_steps,
            self.total_updates,
            schedule.type,
            schedule.warmup_steps,
            schedule.min_lr_ratio,
            schedule.decay_from,
        )
        return self.config.optimizer.learning_rate * factor

    def optimizer_update(self) -> dict[str, float]:
        """Steps the optimizer on the gradients accumulated, at the schedule's rate, the
        gradients clipped to trainer.optimizer.max_grad_norm; their norm and the rate."""
        learning_rate = self.learning_rate()
        self.backend.set_lr(learning_rate)
        grad_norm = float(self.backend.clip_and_step(self.config.optimizer.max_grad_norm))
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "learning_rate": learning_rate}

    # ----------------------------------------------------------------- weights

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
        """Parameters to publish, by the names the rollout-servers load them by
        (`ModelFamily.wire_name`): the float32 master weights under either precision (a
        rollout-server casts them to the dtype it serves in). With LoRA, each target
        layer's weight is merged (W + scale B A) into a new tensor; the model keeps its
        adapters apart and trains on. On a sharded backend: rank 0's copy, gathered at
        the end of the last step (not collective; the other ranks have none)."""
        wire = self.family.wire_name
        if self.sharded:
            return [(wire(name), tensor) for name, tensor in self._published]
        if self.config.lora is None:
            return [(wire(name), p.detach()) for name, p in self.model.named_parameters()]
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
                    layer = layers[owner]
                    if leaf == "weight" and not _plain_linear(layer):  # conv, transposed
                        tensor = tensor + layer.get_delta_weight(ADAPTER)
                    elif leaf == "weight":  # the formula adapters-alone updates merge by
                        tensor = merge_adapter(
                            tensor,
                            layer.lora_A[ADAPTER].weight.detach(),
                            layer.lora_B[ADAPTER].weight.detach(),
                            float(layer.scaling[ADAPTER]),
                        )
                    out.append((wire(f"{owner}.{leaf}"), tensor))
                elif not any(part.startswith("lora_") for part in owner.split(".")):
                    out.append((wire(name), p.detach()))
        return out

    def named_adapters(self) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        """LoRA: every adapted layer's (weight's wire name, frozen base, A, B, scale), whose
        weight `named_weights` publishes merged as base + scale * (B @ A) (the same
        `merge_adapter`). ValueError without LoRA, or for a layer peft stores transposed
        (fan_in_fan_out), whose merged weight is not that formula."""
        from peft.tuners.lora import LoraLayer

        if self.config.lora is None or self.sharded:
            raise ValueError("adapters alone are published by a LoRA run on the local backend")
        wire = self.family.wire_name
        out = []
        for name, module in self.model.get_base_model().named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
                continue
            if not _plain_linear(module):
                raise ValueError(
                    f"{name}: adapters alone go for linear layers stored as [out, in]; this "
                    "one is a convolution or stored transposed (fan_in_fan_out): publish "
                    "merged weights (trainer.weights.adapters: false)"
                )
            out.append(
                (
                    wire(f"{name}.weight"),
                    module.get_base_layer().weight.detach(),
                    module.lora_A[ADAPTER].weight.detach(),
                    module.lora_B[ADAPTER].weight.detach(),
                    float(module.scaling[ADAPTER]),
                )
            )
        return out

    def gather(self) -> None:
        """Sharded backends, every rank (inside a collective call): gathers the full
        weights bucket by bucket (the device holds one bucket at a time); rank 0 keeps a
        CPU copy to publish, and to catch restarted rollout-servers up without asking
        the other ranks."""
        published = []
        for name, tensor in self.backend.iter_full_weights():
            if self.backend.is_main:
                published.append((name, tensor.detach().to("cpu", copy=True)))
        self._published = published

    # ------------------------------------------------------------- checkpoints

    def _parties_with(self, hook: str) -> Iterator[Any]:
        return (p for n, p in self._parties.items() if n != "learner" and hasattr(p, hook))

    def _trainer_state(self, step: int, version: int, extra: dict[str, Any] | None) -> dict:
        return {
            "lr_schedule": {"optimizer_steps": self.optimizer_steps},
            "step": step,
            "policy_version": version,
            "rng": torch.get_rng_state(),
            **(extra or {}),
        }

    @collective
    def save_checkpoint(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Writes a model folder (the family's `from_pretrained` loads it) plus optimizer
        and LR-schedule state, what each attached party saves (`save_state`) and
        `extra`, atomically. With LoRA the folder's model is the merged one and the
        adapters are in its `adapter/` (peft's `save_pretrained`). On a sharded backend
        the folder's model is consolidated from the shards and the sharded state (for
        an exact resume on any backend built the same way) is in its `backend/`."""
        folder = Path(folder)
        state = self._trainer_state(step, version, extra)
        if self.sharded:
            # Every rank writes into one staging folder, renamed once complete.
            staging = folder.with_name(f".{folder.name}.partial")
            self.backend.save_pretrained(staging)
            self.backend.save(staging / "backend")
            for party in self._parties_with("save_state"):
                party.save_state(staging, state)
            if self.backend.is_main:
                state["backend"] = self.backend.name
                torch.save(state, staging / "trainer_state.pt")
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(staging, folder)
            self.backend.barrier()
            return folder
        return self._local_writer(folder, state, copy=False)()

    def checkpoint_writer(
        self, folder: str | Path, step: int, version: int, extra: dict[str, Any] | None = None
    ) -> Callable[[], Path] | None:
        """`save_checkpoint` in two halves, for a checkpoint written while the next steps
        run: this call copies what the checkpoint holds (the weights, the optimizer's
        state) and writes what the attached parties save and LoRA's adapters (small); the
        returned function writes the copies and puts the folder in place whole, from any
        thread. Until it has, the previous checkpoint stays as it was. None on a sharded
        backend, whose ranks write their shards together (`save_checkpoint`)."""
        if self.sharded:
            return None
        state = self._trainer_state(step, version, extra)
        return self._local_writer(Path(folder), state, copy=True)

    def _local_writer(self, folder: Path, state: dict, *, copy: bool) -> Callable[[], Path]:
        """A local backend's checkpoint: the parties' state and LoRA's adapters go into a
        staging folder now, the weights and optimizer state are taken now (copied with
        `copy`, so that steps may run before the write) and written by the function
        returned, which then puts the folder in place whole."""
        staging = staging_folder(folder)
        staging.mkdir()
        taken = copied if copy else (lambda tree: tree)
        try:
            with torch.no_grad():
                if self.config.lora is None:
                    model, weights = self.model, taken(self.model.state_dict())
                else:
                    self.model.save_pretrained(staging / "adapter")
                    # The plain model's config and names, the merged weights (new tensors
                    # already; frozen ones never change).
                    model, weights = self.model.get_base_model(), dict(self.named_weights())
            for party in self._parties_with("save_state"):
                party.save_state(staging, state)
            optimizer = taken(self.optimizer.state_dict())
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

        def write() -> Path:
            try:
                model.save_pretrained(staging, state_dict=weights)
                self.family.save_extras(self.model_path, staging)
                torch.save({"optimizer": optimizer, **state}, staging / "trainer_state.pt")
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staging, folder)
            return folder

        return write

    @collective
    def restore(self, folder: str | Path) -> dict[str, Any]:
        """Loads the weights, optimizer and LR-schedule state of a `save_checkpoint`
        folder and what the parties saved in it; returns its trainer state (step,
        policy_version and what the caller saved with it)."""
        folder = Path(folder)
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        saved_backend = state.get("backend", "local")
        if saved_backend != self.backend.name:
            raise ValueError(
                f"{folder}: a checkpoint of trainer.backend={saved_backend}, but this run's "
                f"is {self.backend.name}; its Hugging Face folder can start a new run "
                "(trainer.model_path) instead"
            )
        for party in self._parties_with("load_state"):
            party.load_state(folder, state)
        if self.sharded:
            self.backend.load(folder / "backend")
            self.optimizer_steps = int(state["lr_schedule"]["optimizer_steps"])
            if "rng" in state:
                torch.set_rng_state(state["rng"])
            self.gather()
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
            self.model.load_state_dict(self.family.load_weights(folder))
        self.optimizer.load_state_dict(state["optimizer"])
        # The loaded groups carry the saved run's settings; this run's config decides
        # (the learning rate is set before every update anyway).
        for group in self.optimizer.param_groups:
            group.update(
                betas=self.config.optimizer.adam_betas,
                eps=self.config.optimizer.adam_eps,
                weight_decay=self.config.optimizer.weight_decay,
            )
        # A checkpoint from before schedules made one update per step.
        schedule = state.get("lr_schedule", {"optimizer_steps": int(state["step"])})
        self.optimizer_steps = int(schedule["optimizer_steps"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        return state


def copied(tree: Any) -> Any:
    """`tree` (dicts, lists and tuples of tensors and plain values, as `state_dict`s are)
    with every tensor copied, tensors that share storage still sharing it (a tied
    embedding and output head stay one tensor)."""
    memo: dict[tuple[int, torch.dtype, tuple], torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape))
            if key not in memo:
                memo[key] = value.detach().clone()
            return memo[key]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(copy(v) for v in value)
        return value

    return copy(tree)


def seed_initialisation(run_seed: int) -> None:
    """Seeds torch for what a trainer makes new (a LoRA adapter, a value or reward head)
    from `run.seed`, alike on every rank: call it before the model is built."""
    from rollwire.services.core.seeds import stream_seed

    torch.manual_seed(stream_seed(run_seed, "init"))
