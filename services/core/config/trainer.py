"""The trainer's section, nested as the trainer's code is: where the model runs (backend,
ranks, device, precision, LoRA), the optimizer and its schedule, how a step's batch is
cut into passes, the algorithm (advantage, loss, correction, KL, ...), checkpointing,
and how weights reach the rollout-servers.

A file written for the flat section of earlier releases still loads: each old key is
moved to its place (`MOVED`) with a warning that names the new key. Imports neither
torch nor grpc; each field's docstring is its help text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rollwire.services.core.config.algorithms import (
    AdvantageConfig,
    CorrectionConfig,
    GRPOAdvantage,
    KLConfig,
    OverlongConfig,
    PolicyLossConfig,
    PPOClipLoss,
    TISCorrection,
)
from rollwire.services.core.config.distributed import DistributedConfig
from rollwire.services.core.config.names import Aggregation, BackendName, ScheduleType
from rollwire.services.core.config.runtime import MiB, ServerConfig, StrictModel

log = logging.getLogger(__name__)

Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerConfig(StrictModel):
    """AdamW and the gradient clip."""

    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate (the peak, when trainer.schedule warms up or decays)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[Beta, Beta] = (0.9, 0.99)
    """AdamW's decay rates of the gradient's first and second moments, e.g. `[0.9, 0.999]`."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the root of the second moment."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip, per optimizer update."""


class LRScheduleConfig(StrictModel):
    """The learning rate over optimizer updates (`rollwire.trainer.math.algorithms.lr_factor`)."""

    type: ScheduleType = "constant"
    """After the warm-up: `constant` keeps trainer.optimizer.learning_rate; `linear` and
    `cosine` decay it to min_lr_ratio times that over the run's rl.max_steps x
    minibatches_per_step x epochs_per_step updates, and hold it there."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer updates over which the rate rises linearly to the learning rate (update
    k of the warm-up, from 0, runs at (k + 1) / warmup_steps of it)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` end, as a fraction of the learning rate."""
    decay_from: Literal["warmup_end", "start"] = "warmup_end"
    """`warmup_end`: `linear` and `cosine` decay from the end of the warm-up; `start`:
    they decay over the whole run from update 0 and the warm-up ramp multiplies them
    (the rate then peaks a little below the learning rate)."""


class BatchingConfig(StrictModel):
    """How a step's batch becomes optimizer updates and forward/backward passes."""

    minibatches_per_step: int = Field(1, ge=1)
    """Optimizer updates per pass over the batch (PPO minibatches: the kept sequences in
    this many contiguous parts). Above 1 (or with epochs_per_step above 1) the proximal
    logprobs cost one extra forward pass per step, and the clip acts from the second
    update on. A batch with fewer sequences that carry signal makes fewer updates."""
    epochs_per_step: int = Field(1, ge=1)
    """Passes over the batch per step (PPO epochs), all against the same proximal
    logprobs; the weights are published once, after the last."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward pass when max_tokens_per_micro_batch is unset;
    gradients accumulate over a minibatch."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Pack sequences, longest first, into forward/backward passes of at most this many
    padded tokens (sequences x the longest of them); a longer sequence goes alone. With
    share_prefix the rows of one prompt are packed together, a group split only where the
    budget ends. Replaces micro_batch_size when set; the gradient is the same either way."""
    share_prefix: bool = True
    """Rows of one pass that begin with the same prompt (a group's samples, a preference
    pair) compute it once: one row holds the prompt and every response after it, each
    response attending to the prompt and itself (the logits and gradients are the plain
    rows', up to float rounding). Used where the model's sizes say it costs less than
    the plain rows (long responses in large groups stay plain); a causal language model's
    forward only. False: every row computes its own copy."""


class AlgorithmConfig(StrictModel):
    """What an RL step computes: rewards to advantages, and the loss."""

    advantage: AdvantageConfig = GRPOAdvantage()
    """The advantage estimator (`type`: grpo, dr_grpo, rloo, lite_ppo,
    reinforce_plus_plus, episode, step, gae, on_policy_distill); sequences whose advantage is 0 are left
    out. `gae` trains a critic (a second model, `advantage.critic`) beside the
    policy: its forward and update passes roughly double a step's time."""
    reward_normalization: Literal["none", "batch", "running"] = "none"
    """Standardise rewards before the advantages: minus the mean, over the std, of the
    batch (`batch`) or of every reward trained on so far (`running`, kept in each
    checkpoint); for estimators that do not normalise within groups (gae,
    reinforce_plus_plus) and rewards on an arbitrary scale."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip every reward to [-reward_clip, reward_clip] before the advantages (a reward
    model's outliers; after reward_normalization, so in std units then); unset leaves
    them as scored."""
    loss: PolicyLossConfig = PPOClipLoss()
    """The policy loss (`type`: ppo_clip, gspo, cispo, topr, raft_plus_plus, reinforce).

    Three logprobs of every generated token meet in it. **Behaviour** (mu): the
    engine's, recorded when it sampled the token; it differs from the others when the
    token is stale (sampled by an older policy version) and by the engine/trainer
    mismatch (kernels, precision: the `mismatch_*` metrics). **Proximal** (pi_prox): the
    trainer's weights before this step's first update, computed once per step.
    **Current** (pi): the weights being updated; equal to the proximal ones in the first
    update of a step, different from the second on (`minibatches_per_step` or
    `epochs_per_step` above 1), which is where a clip acts."""
    correction: CorrectionConfig = TISCorrection()
    """The off-policy correction (`type`: none, tis, decoupled, mis): what the ratio is
    taken against (mu, or pi_prox) and how each token is weighted or masked by
    pi_prox / mu."""
    aggregation: Aggregation = "token_mean"
    """How token losses become the loss: the mean over all tokens, the mean over
    sequences of their sums or of their means, or the token sum over sequences x
    `aggregation_constant` (Dr. GRPO)."""
    aggregation_constant: float | None = Field(None, gt=0)
    """`aggregation: constant`: the fixed length each sequence's sum is divided by (the
    run's orchestrator.max_new_tokens, say)."""
    overlong: OverlongConfig = OverlongConfig()
    """DAPO's overlong filtering (mask_truncated) and soft length penalty (penalty_tokens)."""
    kl: KLConfig = KLConfig()
    """KL penalty to the initial model (a frozen reference; the base model under LoRA)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: this times the policy's mean token entropy is subtracted from the
    loss (its gradient then costs a softmax over the vocabulary per token)."""

    @model_validator(mode="after")
    def _settings_compose(self) -> AlgorithmConfig:
        if self.kl.in_reward and self.kl.coef == 0:
            raise ValueError("trainer.algorithm.kl.in_reward needs trainer.algorithm.kl.coef > 0")
        if self.kl.in_reward and self.advantage.type not in ("gae", "reinforce_plus_plus"):
            raise ValueError(
                "trainer.algorithm.kl.in_reward folds the KL into token rewards, which only "
                "gae and reinforce_plus_plus take; trainer.algorithm.advantage is "
                f"{self.advantage.type} (use the KL as a loss term there: leave in_reward false)"
            )
        if self.aggregation == "constant" and self.aggregation_constant is None:
            raise ValueError(
                "trainer.algorithm.aggregation: constant needs "
                "trainer.algorithm.aggregation_constant (the fixed length, e.g. the run's "
                "orchestrator.max_new_tokens)"
            )
        return self


class CheckpointingConfig(StrictModel):
    """When the trainer writes checkpoints, and whether it starts from one."""

    every: int = Field(10, ge=0)
    """Steps between checkpoints. The buffer keeps the batches trained since the last
    checkpoint until the next one holds them, so a restarted trainer resumes from its
    checkpoint and trains them again: nothing lost. 0 writes only the final checkpoint,
    and batches are let go as soon as they are trained (a crash then loses them)."""
    resume: bool = True
    """Start from the newest checkpoint under run.output_dir/checkpoints when there is one
    (a restarted trainer carries on where its checkpoint left off)."""
    background: bool = True
    """Write checkpoints while the next steps run: the weights and optimizer state are
    copied at the step (memory for one more copy of each) and written by a thread; the
    buffer lets go of the checkpoint's batches only once it is in place, and a crash
    while it is written leaves the previous one whole. The final checkpoint, and any on
    a sharded backend (its ranks write together), are written before going on."""


class WeightsConfig(StrictModel):
    """How new weights reach the rollout-servers."""

    transport: Literal["stream", "group"] = "stream"
    """`stream`: a chunked gRPC stream to each (any engine, any network). `group`:
    broadcasts in a process group of the trainer and every rollout-server (NCCL between
    GPUs, gloo on CPUs), the control still on gRPC; if a member is lost the run goes on
    with streams (`weight_group_failures`)."""
    chunk_bytes: int = Field(4 * MiB, ge=1024)
    """Size of one chunk of a weight update."""
    group_address: str = "127.0.0.1"
    """`group`: the address rollout-servers reach this trainer's rendezvous store at (the
    port is picked by the OS)."""
    group_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`group`: NCCL when this trainer has a CUDA GPU (auto), else gloo."""
    group_timeout_seconds: float = Field(60.0, gt=0)
    """`group`: how long forming the group, or one broadcast, may take."""
    deltas: bool = False
    """`stream`: send a rollout-server that holds the last version only the bytes that
    changed since (element indices and new values, a tensor whole where that is
    smaller, unchanged tensors not at all), each tensor with its SHA-256, checked on
    arrival; a server that does not hold the base or finds a mismatch is sent the
    version whole (`trainer_deltas_refused`). Pays where few bytes change: with 16-bit
    weights (see docs/benchmarks.md); with float32 nearly every element changes each
    step. Costs the model's size in CPU memory twice on the trainer (the last version
    and its encoding) and once on each rollout-server (the base it keeps)."""
    adapters: bool = False
    """A LoRA run (`trainer.lora`): send each version as the adapted layers' adapters
    alone (A, B and the scale of each; each layer's frozen base once per server), which
    the rollout-server merges itself (base + scale * B A, the trainer's formula) into
    the weights its engine serves, so every engine takes them. A server that lost the
    bases (restarted) refuses and gets them again (`trainer_adapters_refused`). Streams
    only; instead of `deltas`."""
    store: bool = True
    """Keep the newest published version on the trainer's CPU for any rollout-server to
    fetch (`TrainerService.FetchWeights`, whole, every tensor checksummed): what a
    rollout-server with `rollout_server.weights_from` pulls when it starts, so one the
    trainer does not know yet, or one restarted, serves the current version. Costs a copy
    of the weights in CPU memory (taken beside each publish), and their encoding while
    a fetch of that version is answered."""
    overlap_publish: bool = False
    """Async mode: the new weights are copied and sent while the trainer acknowledges,
    waits for its next batch and starts the next step, instead of before (the copy costs
    the model's size in memory once more, on the device the weights are on; a sharded
    backend's gathered copy is used as it is). The next publish waits for this one, so
    versions arrive in order. Sync mode always sends first: generation waits for them.
    Off by default: on 2 CPU cores with a 27M model it made steps 1.15x longer (the
    sending competes with generation for the cores, and the rollout-servers serve the
    new version later, so the orchestrator waits at the staleness bound more)."""

    @model_validator(mode="after")
    def _deltas_go_by_stream(self) -> WeightsConfig:
        for name in ("deltas", "adapters"):
            if getattr(self, name) and self.transport != "stream":
                raise ValueError(
                    f"trainer.weights.{name} needs transport: stream (a group broadcasts "
                    "whole tensors)"
                )
        if self.deltas and self.adapters:
            raise ValueError(
                "trainer.weights.adapters and deltas are two ways to send less: choose one "
                "(adapters send far less in a LoRA run)"
            )
        return self


class LoraConfig(StrictModel):
    """LoRA adapters (peft) on the local backend: only the adapters train, the base
    weights stay frozen; the weights published and saved are the merged ones."""

    rank: int = Field(16, ge=1)
    """Rank r of each adapter: the inner size of its B (out x r) and A (r x in)."""
    alpha: float = 32.0
    """Scale numerator: a target layer's weight is W + (alpha / rank) B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on each adapter's input in training passes (the proximal pass too, so
    above 0 the first update's ratio is no longer exactly 1)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    """Suffixes of the names of the linear layers that get an adapter, e.g. `q_proj`
    or `mlp.down_proj`."""


MOVED = {
    "learning_rate": "optimizer.learning_rate",
    "weight_decay": "optimizer.weight_decay",
    "adam_betas": "optimizer.adam_betas",
    "adam_eps": "optimizer.adam_eps",
    "max_grad_norm": "optimizer.max_grad_norm",
    "lr_schedule": "schedule",
    "minibatches_per_step": "batching.minibatches_per_step",
    "epochs_per_step": "batching.epochs_per_step",
    "micro_batch_size": "batching.micro_batch_size",
    "max_tokens_per_micro_batch": "batching.max_tokens_per_micro_batch",
    "advantage": "algorithm.advantage",
    "reward_normalization": "algorithm.reward_normalization",
    "reward_clip": "algorithm.reward_clip",
    "loss": "algorithm.loss",
    "correction": "algorithm.correction",
    "aggregation": "algorithm.aggregation",
    "aggregation_constant": "algorithm.aggregation_constant",
    "overlong": "algorithm.overlong",
    "kl": "algorithm.kl",
    "entropy_coef": "algorithm.entropy_coef",
    "checkpoint_every": "checkpointing.every",
    "resume": "checkpointing.resume",
    "weight_transport": "weights.transport",
    "weight_chunk_bytes": "weights.chunk_bytes",
    "weight_group_address": "weights.group_address",
    "weight_group_backend": "weights.group_backend",
    "weight_group_timeout_seconds": "weights.group_timeout_seconds",
    "overlap_publish": "weights.overlap_publish",
}
"""Keys of the flat trainer section of earlier releases, and where each lives now."""

_warned: set[str] = set()


def _warn_moved(old: str) -> None:
    if old not in _warned:
        _warned.add(old)
        log.warning("trainer.%s is now trainer.%s: it was read as that", old, MOVED[old])


def move_flat_keys(section: dict[str, Any]) -> dict[str, Any]:
    """A trainer section with each key of the flat section of earlier releases moved to its
    place (`MOVED`), with a warning naming the new key (once per key and process); the
    old and the new key of one setting together are an error."""
    if not any(key in MOVED for key in section):
        return section
    section = dict(section)
    for old, new in MOVED.items():
        if old not in section:
            continue
        value = section.pop(old)
        *parents, leaf = new.split(".")
        place = section
        for part in parents:
            inner = place.get(part) or {}
            if not isinstance(inner, dict):
                inner = inner.model_dump(exclude_unset=True)
            place[part] = inner = dict(inner)
            place = inner
        if leaf in place:
            raise ValueError(f"trainer.{old} and trainer.{new} are one setting: keep trainer.{new}")
        place[leaf] = value
        _warn_moved(old)
    return section


def moved_keys(keys: list[str]) -> list[str]:
    """The dotted path of an override (`--set`, an environment variable) with a flat
    trainer key of earlier releases moved to its place."""
    if len(keys) >= 2 and keys[0] == "trainer" and keys[1] in MOVED:
        _warn_moved(keys[1])
        return ["trainer", *MOVED[keys[1]].split("."), *keys[2:]]
    return keys


class TrainerConfig(StrictModel):
    """The trainer.

    A step takes one batch from the buffer and publishes the weights once, as one new
    policy version. Within it the trainer computes the advantages and the proximal
    logprobs (see `trainer.algorithm.loss`), then makes epochs_per_step passes over the
    batch in minibatches_per_step minibatches (`trainer.batching`), one optimizer update
    each; each minibatch is split into micro-batches whose gradients accumulate.
    """

    server: ServerConfig = ServerConfig()
    """Listening settings for the TrainerService."""
    model_path: Path | None = None
    """Model to start from (Hugging Face folder); the built-in tiny model when unset.
    `rollwire train` starts the rollout-servers from the same model (setting
    `rollout_server.model_path` to another one is an error)."""
    backend: BackendName = "local"
    """`local`: one process on CPU or one GPU. `fsdp2`: torch FSDP2 (parameters, gradients
    and optimizer state sharded over the ranks); `deepspeed`: DeepSpeed ZeRO stage 1, 2
    or 3 (`trainer.distributed`). Either runs `world_size` ranks (gloo on CPUs, NCCL on
    GPUs); rank 0 alone talks to the buffer and the rollout-servers."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks on this machine (one per GPU; on CPUs, one per `threads` cores).
    Above 1, `rollwire trainer` starts itself under torchrun (`--standalone`); for several
    machines run `torchrun --nnodes ... -m rollwire.services.app.cli trainer -c FILE` on
    each with torchrun's own rendezvous options, and WORLD_SIZE decides."""
    distributed: DistributedConfig = DistributedConfig()
    """Settings of the `fsdp2` and `deepspeed` backends (collective timeout, resharding,
    ZeRO stage, offload)."""
    device: str = "cpu"
    """torch device, e.g. `cpu` or `cuda:0`."""
    threads: int = Field(1, ge=1)
    """CPU threads torch may use in this process."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: forward and backward passes under bfloat16 autocast, with float32 master
    weights, optimizer state and loss math (logprobs, ratios, advantages). Published
    weights and checkpoints stay float32; a rollout-server casts them to its own dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (Hugging Face
    `gradient_checkpointing_enable`): less memory, about one more forward of time."""
    freeze: list[str] = []
    """Module prefixes whose parameters do not train, by their names in the loaded model
    (e.g. `model.visual`: a vision-language model's vision tower); each must name some.
    The optimizer holds only the others; checkpoints and published weights keep them all."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of all the weights (`local` backend only). The rollout-servers
    get the merged weights; a checkpoint holds the adapters (`adapter/`) and the merged
    model as its Hugging Face folder. A KL reference is then the base model itself
    (the adapters switched off), not a second copy."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and the gradient clip."""
    schedule: LRScheduleConfig = LRScheduleConfig()
    """Learning rate over the run's optimizer updates; its position is saved in every
    checkpoint, so a resumed run carries on along it."""
    batching: BatchingConfig = BatchingConfig()
    """Minibatches, epochs and micro-batches of a step."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The RL step's advantage estimator, loss, correction, KL and reward shaping."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoints and resuming."""
    weights: WeightsConfig = WeightsConfig()
    """How weights reach the rollout-servers."""
    batch_timeout_seconds: float = Field(600.0, gt=0)
    """Waiting longer than this for a batch is an error naming what to check."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_move(cls, data: Any) -> Any:
        return move_flat_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _backend_settings_compose(self) -> TrainerConfig:
        if self.world_size > 1 and self.backend == "local":
            raise ValueError(
                f"trainer.world_size={self.world_size} needs trainer.backend fsdp2 or deepspeed "
                "(local is one process)"
            )
        if self.backend != "local" and self.lora is not None:
            raise ValueError(f"trainer.lora runs on trainer.backend=local only, not {self.backend}")
        if self.weights.adapters and self.lora is None:
            raise ValueError(
                "trainer.weights.adapters sends a LoRA run's adapters: set trainer.lora too"
            )
        if self.backend != "local" and self.algorithm.kl.coef > 0:
            raise ValueError(
                f"trainer.algorithm.kl.coef > 0 (a frozen reference model) runs on "
                f"trainer.backend=local only, not {self.backend}"
            )
        return self
