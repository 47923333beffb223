"""The run config: one model composing every section.

One YAML file describes a whole run; every service reads the same file and
uses its own section, so docker-compose and Kubernetes can hand one file to
all of them. Unknown keys are rejected everywhere. Each field's docstring is
its help text.

The sections live by what they configure: `runtime` (the base model, TLS, auth,
CURVE, how services listen and call, telemetry), `servers` (env-server,
reward-server, rollout-server, buffer, trainer) and `orchestrator` (datasets,
multi-turn episodes). This module composes them, holds the sections every
service shares, and re-exports the rest, so `config.models.X` keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rollwire.services.core.config.algorithms import KLConfig
from rollwire.services.core.config.orchestrator import (
    CHAIN_SUM_SMALL,
    AgentConfig,
    DatasetConfig,
    DigitsDataset,
    EnvDataset,
    FileDataset,
    ImageDataset,
    ImageSamplingConfig,
    MixtureDataset,
    MixturePart,
    OrchestratorConfig,
    ReasoningGymDataset,
    SingleDataset,
    scored_domains,
    share_key,
)
from rollwire.services.core.config.pipelines import (
    DIFFERENTIABLE_DOMAINS,
    DistillConfig,
    DPOConfig,
    PipelineSections,
    RewardFLConfig,
    RewardModelTrainingConfig,
    SFTConfig,
)
from rollwire.services.core.config.runtime import (
    Z85_ALPHABET,
    AuthConfig,
    ClientConfig,
    CurveClientConfig,
    CurveServerConfig,
    MiB,
    ServerConfig,
    StrictModel,
    TelemetryConfig,
    TLSConfig,
    check_curve_key,
    read_token_file,
)
from rollwire.services.core.config.servers import (
    BufferConfig,
    EnvSandboxConfig,
    EnvServerConfig,
    JudgeConfig,
    McpConfig,
    McpServerConfig,
    RewardModelConfig,
    RewardServerConfig,
    RolloutServerConfig,
    SandboxConfig,
)
from rollwire.services.core.config.trainer import (
    AlgorithmConfig,
    BatchingConfig,
    CheckpointingConfig,
    LoraConfig,
    LRScheduleConfig,
    OptimizerConfig,
    TrainerConfig,
    WeightsConfig,
)
from rollwire.services.core.images import FORMATS, ImageLimits

__all__ = [
    "CHAIN_SUM_SMALL",
    "DIFFERENTIABLE_DOMAINS",
    "Z85_ALPHABET",
    "AgentConfig",
    "AlgorithmConfig",
    "AuthConfig",
    "BatchingConfig",
    "BufferConfig",
    "CheckpointingConfig",
    "ClientConfig",
    "CurveClientConfig",
    "CurveServerConfig",
    "DPOConfig",
    "DatasetConfig",
    "DigitsDataset",
    "DistillConfig",
    "EndpointsConfig",
    "EnvDataset",
    "EnvSandboxConfig",
    "EnvServerConfig",
    "FileDataset",
    "ImageDataset",
    "ImageInputsConfig",
    "ImageSamplingConfig",
    "JudgeConfig",
    "KLConfig",
    "LRScheduleConfig",
    "LoraConfig",
    "McpConfig",
    "McpServerConfig",
    "MiB",
    "MixtureDataset",
    "MixturePart",
    "OptimizerConfig",
    "OrchestratorConfig",
    "PipelineSections",
    "RLSection",
    "RayLauncher",
    "RayPlacement",
    "ReasoningGymDataset",
    "RewardFLConfig",
    "RewardModelConfig",
    "RewardModelTrainingConfig",
    "RewardServerConfig",
    "RolloutServerConfig",
    "RunConfig",
    "RunSection",
    "SFTConfig",
    "SandboxConfig",
    "ServerConfig",
    "SingleDataset",
    "StrictModel",
    "TLSConfig",
    "TelemetryConfig",
    "TrainerConfig",
    "WarmupConfig",
    "WeightsConfig",
    "check_curve_key",
    "read_token_file",
    "scored_domains",
    "share_key",
]


class EndpointsConfig(StrictModel):
    """Where the services are. `rollwire up`/`train` fill these in; on a cluster, write them."""

    rollout_servers: list[str] = []
    """Rollout-server addresses (host:port); a `dns:///name:port` entry stands for every
    address the name resolves to, looked up again during the run (replicas join and
    leave)."""
    reward_servers: list[str] = []
    """Reward-server addresses (host:port, or `dns:///name:port` as for rollout-servers)."""
    teacher_servers: list[str] = []
    """Rollout-server addresses of on-policy distillation's teacher (`trainer.algorithm.advantage:
    on_policy_distill`); `rollwire train` starts one on distill.teacher_model_path when
    empty."""
    env_servers: list[str] = []
    """Env-server addresses (host:port); a `dns:///name:port` entry stands for every
    address the name resolves to. Empty with an `env` dataset: environments run inside the
    orchestrator."""
    buffer_producer: str | None = None
    """Buffer endpoint for producers, e.g. tcp://127.0.0.1:5555."""
    buffer_trainer: str | None = None
    """Buffer endpoint for the trainer."""
    trainer: str | None = None
    """TrainerService address (host:port)."""
    members_file: str | None = None
    """A JSON file of role -> addresses (`rollout-server`, `reward-server`, `env-server`)
    read again during the run, replacing a role's list above where it names the role:
    `rollwire train` writes one in the run folder and `rollwire scale` changes it."""
    refresh_seconds: float = Field(5.0, gt=0)
    """How often DNS names and the members file are looked at again."""


class RLSection(StrictModel):
    """What every RL service must agree on: groups, batch size, staleness, length of the run."""

    mode: Literal["async", "sync"] = "async"
    """`async`: generation runs ahead of training by up to `max_staleness` versions.
    `sync`: staleness 0, generation and training never overlap (the baseline)."""
    max_staleness: int = Field(1, ge=0)
    """With trainer version v, no token generated before version v - max_staleness is trained on."""
    group_size: int = Field(8, ge=1)
    """Responses sampled per prompt (the group of group-relative advantages)."""
    groups_per_step: int = Field(32, ge=1)
    """Prompts (groups) per optimizer step."""
    max_steps: int = Field(100, ge=1)
    """Optimizer steps in the run."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer recomputes logprobs at the same temperature."""

    @property
    def staleness(self) -> int:
        """The bound in effect: 0 in sync mode."""
        return 0 if self.mode == "sync" else self.max_staleness


class WarmupConfig(StrictModel):
    """A short supervised stage before RL, on the training dataset with another seed."""

    steps: int = Field(800, ge=0)
    """Optimizer steps; 0 skips the stage."""
    batch_size: int = Field(64, ge=1)
    """Examples per step."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak learning rate: step k runs at it x min(1, (k + 1) / 20) x (1 - k / steps)."""
    response_template: str = "<answer>{answer}</answer>"
    """What the model is taught to answer, formatted with the reference `answer`."""
    seed: int = 1
    """Dataset seed of the warm-up examples (keep it apart from the evaluation seed)."""
    dataset_size: int = Field(20_000, ge=1)
    """Examples generated for the stage."""
    demo_kwargs: dict[str, Any] = {}
    """For an `env` dataset: arguments of the env's scripted demonstrator, whose episodes
    are the warm-up examples (see `rollwire.envs.demos`)."""
    off_by_one_rate: float = Field(0.9, ge=0, le=1)
    """Fraction of integer answers taught as reference + 1: a deliberately flawed
    starting point, like a model tuned on noisy demonstrations, whose systematic
    mistake the reward can reveal and RL can undo."""


RAY_ROLES = (
    "buffer",
    "reward-server",
    "rollout-server",
    "env-server",
    "teacher-server",
    "trainer",
    "orchestrator",
)
"""The services `rollwire train` and `up` start, as `run.ray.services` names them."""


class RayPlacement(StrictModel):
    """What one service asks of a Ray cluster (Ray's own resource names)."""

    num_cpus: float | None = Field(None, ge=0)
    """CPUs reserved for it; unset: its thread count (`trainer.threads`,
    `rollout_server.threads`; 1 for the others), times the ranks for a trainer."""
    num_gpus: float = Field(0, ge=0)
    """GPUs (per trainer rank); Ray sets CUDA_VISIBLE_DEVICES for the process."""
    memory: int | None = Field(None, ge=0)
    """Bytes of memory reserved (Ray's `memory`); unset: none."""
    resources: dict[str, float] = {}
    """Custom resources, e.g. `{node_kind_gpu: 1}` for nodes started with that label."""


class RayLauncher(StrictModel):
    """Run every service as a process on a Ray cluster instead of this machine
    (`rollwire.services.app.ray_cluster`). The run folder (`run.output_dir`) and the model
    cache must be on storage every node mounts at the same path, and every node must have
    rollwire installed at the launcher's Python path: checked when each service starts."""

    address: str
    """The cluster: its GCS `host:port` (what `ray start --head` prints), or `auto` for
    the cluster this machine belongs to."""
    services: dict[Literal[RAY_ROLES], RayPlacement] = {}  # type: ignore[valid-type]
    """Resources per service (`buffer`, `reward-server`, `rollout-server`, `env-server`,
    `teacher-server`, `trainer`, `orchestrator`); those not named take the defaults.
    The resources are per trainer rank; the ranks are gang-placed (`trainer_nodes`)."""
    trainer_nodes: int = Field(1, ge=1)
    """Nodes the trainer's ranks (`trainer.world_size`, which it must divide) are spread
    over, as many on each: one placement-group bundle per node (`STRICT_SPREAD`), each
    node's torchrun joining rank 0's rendezvous. 1: every rank on one node."""
    spread: bool = True
    """Spread the services over the cluster's nodes (Ray's SPREAD strategy); false packs
    them where Ray chooses."""
    place_seconds: float = Field(300.0, gt=0)
    """How long a service (or the trainer's gang) may wait for the cluster to have room
    before the run stops with what it asked for."""


class RunSection(StrictModel):
    """What identifies a run and where its outputs go."""

    name: str = "rollwire"
    """Run name, used in logs and output paths."""
    output_dir: Path = Path("runs/default")
    """Run directory: resolved config, logs, checkpoints, the buffer's log."""
    seed: int = 0
    """Seed of the run's randomness: mixed into the order of the training prompts (and an
    offline pipeline's rows), the samples' seeds (`orchestrator.sampling_seed`), the
    rollout engine's generator (`rollout_server.seed`) and what the trainer initialises
    (an adapter, a head). 0 leaves each as set; the prompts themselves and the held-out
    set stay the same whatever the seed (`rollwire.services.core.seeds`)."""
    local_env_servers: int | None = Field(None, ge=1)
    """Env-servers `rollwire train` starts for an `env` dataset (1 when unset); not with
    `endpoints.env_servers`, which names servers already running. A resolved config lists
    the started ones in `endpoints.env_servers` and leaves this unset."""
    local_rollout_servers: int = Field(1, ge=1)
    """Rollout-servers `rollwire train` starts, each on the whole model: the orchestrator
    sends groups to them in turn and the trainer sends each the weights. On a CPU machine
    this is how generation uses several cores: a small model scales badly on threads (on
    2 cores, a sync step of a 2.3M-parameter model waited 1.32x as long for its batch with
    the rollout-server on two threads as on one). With `run.cpu_threads` the plan's
    generation threads are divided among them, at least one each."""
    tiny_model: dict[str, int] = {}
    """Shape overrides of the built-in tiny model (fields of `rollwire.services.core.tiny.TinySpec`)."""
    cpu_threads: int = Field(0, ge=0)
    """CPU threads the trainer and the rollout-server of a local run (`rollwire train`,
    `rollwire up`) share: one plan for the machine instead of each service's `threads`
    (0 keeps those). In sync mode the two take turns: the trainer's step gets all of them,
    generation all but one (the orchestrator and the reward-server work beside it). In async mode they start split in half, and every 10 steps the trainer moves one
    thread toward the side that is behind, from its own measured idle time (idle over
    25% of the step: a thread to generation; under 5%: one back). HF engines and the
    `local` trainer backend change their torch threads at run time. vLLM and SGLang
    engines keep the threads they started with: the trainer then moves alone, taking
    threads beside them while it hardly waits (up to all of them; generation idle at the
    staleness bound leaves its cores free) and giving them back when it waits.
    fsdp2/deepspeed ranks keep theirs, and so does the plan."""
    ray: RayLauncher | None = None
    """Place every service of `rollwire train`/`up` on a Ray cluster (`address`, resources
    per service); unset: local processes. Restarts keep the local launcher's limits."""


class ImageInputsConfig(StrictModel):
    """What an image in a prompt, an observation or a trajectory may be, for every service
    that opens one (`rollwire.services.core.images`): past a limit it is refused with an
    error naming it, and the service keeps serving."""

    max_bytes: int = Field(ImageLimits.max_bytes, ge=1)
    """Largest encoded image, given by value or read from a file."""
    max_pixels: int = Field(ImageLimits.max_pixels, ge=1)
    """Largest width x height (checked before the pixels are decoded)."""
    formats: list[Literal[FORMATS]] = list(FORMATS)
    """Formats an image may be in (its bytes decide, not its name): png, jpeg, webp, gif, bmp."""
    roots: list[str] = []
    """Folders a referenced image (a path or file:// URI) may lie in; empty: any local
    path. Nothing is read from the network."""

    def limits(self) -> ImageLimits:
        return ImageLimits(self.max_bytes, self.max_pixels, tuple(self.formats), tuple(self.roots))


class RunConfig(PipelineSections):
    """A whole run: every service reads this file and uses its own section (the
    pipelines' sections come from `PipelineSections`)."""

    run: RunSection = RunSection()
    """Identity and outputs of the run."""
    rl: RLSection = RLSection()
    """Settings every RL service shares."""
    warmup: WarmupConfig = WarmupConfig()
    """Supervised warm-up run by `rollwire train` before the services start."""
    telemetry: TelemetryConfig = TelemetryConfig()
    """Logs and traces, for every service."""
    client: ClientConfig = ClientConfig()
    """How services call one another."""
    env_server: EnvServerConfig = EnvServerConfig()
    """The env-server."""
    reward_server: RewardServerConfig = RewardServerConfig()
    """The reward-server."""
    rollout_server: RolloutServerConfig = RolloutServerConfig()
    """The rollout-server."""
    buffer: BufferConfig = BufferConfig()
    """The replay buffer."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""
    endpoints: EndpointsConfig = EndpointsConfig()
    """Addresses of the services, for the ones that call others."""
    image_inputs: ImageInputsConfig = ImageInputsConfig()
    """Limits on images (a vision-language model's prompts and observations)."""

    @model_validator(mode="after")
    def _trainer_nodes_divide_the_ranks(self) -> RunConfig:
        ray, world = self.run.ray, self.trainer.world_size
        if ray is not None and world % ray.trainer_nodes:
            raise ValueError(
                f"run.ray.trainer_nodes {ray.trainer_nodes} does not divide trainer.world_size "
                f"{world}: every node runs as many ranks"
            )
        return self

    @model_validator(mode="after")
    def _on_policy_distillation_has_a_teacher(self) -> RunConfig:
        if self.trainer.algorithm.advantage.type != "on_policy_distill":
            return self
        if self.distill.teacher_model_path is None and not self.endpoints.teacher_servers:
            raise ValueError(
                "trainer.algorithm.advantage on_policy_distill needs a teacher: set "
                "distill.teacher_model_path (a Hugging Face folder rollwire train serves) or "
                "endpoints.teacher_servers"
            )
        if self.rl.temperature != 1.0:
            raise ValueError(
                "trainer.algorithm.advantage on_policy_distill compares the student's and the teacher's "
                f"own distributions: set rl.temperature to 1 (it is {self.rl.temperature})"
            )
        if self.orchestrator.filter_uniform_groups:
            raise ValueError(
                "orchestrator.filter_uniform_groups drops groups whose rewards are all equal, "
                "but on-policy distillation learns from every group's tokens: turn it off"
            )
        return self

    @model_validator(mode="after")
    def _images_come_from_a_diffusion_engine(self) -> RunConfig:
        images = self.orchestrator.dataset.type == "images"
        diffusion = self.rollout_server.engine == "diffusion"
        if images != diffusion:
            raise ValueError(
                "an `images` dataset is sampled by rollout_server.engine: diffusion, and that "
                "engine samples only images: set both or neither "
                f"(orchestrator.dataset.type={self.orchestrator.dataset.type}, "
                f"rollout_server.engine={self.rollout_server.engine})"
            )
        if not images:
            if self.reward_fl.enabled:
                raise ValueError(
                    "reward_fl trains a diffusion model: set rollout_server.engine: diffusion "
                    "and an `images` dataset"
                )
            return self
        band = self.orchestrator.images.quality_band
        every, eval_every = self.trainer.checkpointing.every, self.orchestrator.eval_every
        if band is not None and (not every or not eval_every or eval_every % every):
            raise ValueError(
                "orchestrator.images.quality_band keeps the last evaluation inside the band "
                "as the run's result, so its version needs a checkpoint: "
                f"trainer.checkpointing.every ({every}) must divide orchestrator.eval_every "
                f"({eval_every}), both above 0"
            )
        if band is not None and "digit" not in scored_domains(self.orchestrator.eval_dataset):
            raise ValueError(
                "orchestrator.images.quality_band watches the digit judge's Frechet distance "
                "and diversity: the evaluation set's domain must be digit"
            )
        if self.reward_fl.enabled:
            return self._reward_fl_fits()
        if self.reward_fl.grad_steps != RewardFLConfig().grad_steps:
            raise ValueError(
                "reward_fl.grad_steps is set but reward_fl.enabled is false: this run is "
                "Flow-GRPO; enable reward_fl or drop the setting"
            )
        if self.trainer.algorithm.advantage.type in ("gae", "on_policy_distill"):
            raise ValueError(
                "Flow-GRPO takes a group estimator for trainer.algorithm.advantage (grpo, "
                f"rloo, ...), not {self.trainer.algorithm.advantage.type}"
            )
        if self.trainer.algorithm.kl.in_reward:
            raise ValueError(
                "Flow-GRPO's KL is a loss term (trainer.algorithm.kl.coef); kl.in_reward "
                "is for token rewards"
            )
        return self

    def _reward_fl_fits(self) -> RunConfig:
        images = self.orchestrator.images
        for name in ("eta", "sde_window"):
            if getattr(images, name) is not None:
                raise ValueError(
                    f"orchestrator.images.{name} is Flow-GRPO's: reward feedback learning "
                    "samples by the ODE and records the last reward_fl.grad_steps steps; "
                    "drop it"
                )
        if self.reward_fl.grad_steps > images.steps:
            raise ValueError(
                f"reward_fl.grad_steps ({self.reward_fl.grad_steps}) cannot exceed "
                f"orchestrator.images.steps ({images.steps})"
            )
        domains = scored_domains(self.orchestrator.dataset)
        if not domains <= set(DIFFERENTIABLE_DOMAINS):
            raise ValueError(
                f"reward feedback learning needs a differentiable reward; the domain "
                f"{sorted(domains - set(DIFFERENTIABLE_DOMAINS))[0]!r} has none (these have: "
                f"{', '.join(DIFFERENTIABLE_DOMAINS)})"
            )
        if self.orchestrator.dataset.metadata.get("pay", "probability") != "probability":
            raise ValueError(
                "reward feedback learning follows the digit judge's probability: "
                "orchestrator.dataset.metadata.pay: correct has no gradient"
            )
        return self

    @model_validator(mode="after")
    def _env_servers_come_from_one_place(self) -> RunConfig:
        if self.endpoints.env_servers and self.run.local_env_servers is not None:
            raise ValueError(
                "run.local_env_servers starts env-servers and endpoints.env_servers names "
                "running ones; set one of them"
            )
        return self

    @model_validator(mode="after")
    def _overlong_limit_is_the_orchestrators(self) -> RunConfig:
        overlong = self.trainer.algorithm.overlong
        if overlong.penalty_tokens is not None and overlong.max_tokens is None:
            limit = self.orchestrator.max_new_tokens
            if overlong.penalty_tokens > limit:
                raise ValueError(
                    f"trainer.algorithm.overlong.penalty_tokens={overlong.penalty_tokens} is more than "
                    f"orchestrator.max_new_tokens={limit}"
                )
            self.trainer.algorithm.overlong = overlong.model_copy(update={"max_tokens": limit})
        return self

    @model_validator(mode="after")
    def _shares_fit_the_batch_and_the_mixture(self) -> RunConfig:
        shares = self.buffer.batch_shares
        if not shares:
            return self
        if any(count < 1 for count in shares.values()):
            raise ValueError(f"buffer.batch_shares must be positive counts, got {shares}")
        if sum(shares.values()) != self.rl.groups_per_step:
            raise ValueError(
                f"buffer.batch_shares add up to {sum(shares.values())}, but a batch holds "
                f"rl.groups_per_step={self.rl.groups_per_step} groups"
            )
        dataset = self.orchestrator.dataset
        if isinstance(dataset, EnvDataset):
            produced = {dataset.env_id: 1}
        elif isinstance(dataset, MixtureDataset):
            produced = {}
            for part in dataset.parts:
                key = share_key(part.dataset, self.buffer.share_by)
                produced[key] = produced.get(key, 0) + part.weight
        else:
            produced = {share_key(dataset, self.buffer.share_by): 1}
        total_weight, total_share = sum(produced.values()), sum(shares.values())
        if set(produced) != set(shares) or any(
            produced[k] * total_share != shares[k] * total_weight for k in shares
        ):
            raise ValueError(
                f"buffer.batch_shares {shares} (by {self.buffer.share_by}) do not match what "
                f"the orchestrator's dataset produces, in proportion {produced}: give the "
                "mixture's parts weights in the same proportions, or the batches would wait "
                "for groups that come too rarely"
            )
        return self
