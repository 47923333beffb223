"""The configuration models. Each field's docstring is its help text.

One YAML file describes a whole run; every service reads the same file and
uses its own section, so docker-compose and Kubernetes can hand one file to
all of them. Unknown keys are rejected everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

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


class TelemetryConfig(StrictModel):
    """Logs and traces."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe level written."""
    log_format: Literal["json", "text"] = "json"
    """`json`: one object per line with service, trace and span ids; `text` for people."""
    trace_exporter: Literal["none", "console"] = "none"
    """Where spans go. Trace context is propagated in call metadata either way."""


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
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Generation engine: Hugging Face transformers, vLLM or SGLang."""
    model_path: Path | None = None
    """Local Hugging Face model folder; the built-in tiny model when unset."""
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
    data_dir: Path | None = None
    """Where the trajectory log lives; under the run directory when unset."""
    max_frame_bytes: int = Field(256 * MiB, ge=4096)
    """Frames larger than this are rejected without being decoded."""
    max_ready_groups: int = Field(10_000, ge=1)
    """Complete groups held at most; puts beyond it are refused with reason "full"."""


class TrainerConfig(StrictModel):
    """The trainer."""

    server: ServerConfig = ServerConfig()
    """Listening settings for the TrainerService."""
    backend: Literal["local", "fsdp2", "deepspeed"] = "local"
    """Single process on CPU or one GPU, or torch.distributed / DeepSpeed."""


class OrchestratorConfig(StrictModel):
    """The orchestrator: drives episodes and feeds the buffer."""

    env_servers: list[str] = []
    """Env-server addresses (host:port)."""
    reward_servers: list[str] = []
    """Reward-server addresses (host:port)."""
    rollout_servers: list[str] = []
    """Rollout-server addresses (host:port)."""
    max_concurrent_episodes: int = Field(64, ge=1)
    """Episodes in flight at once."""


class RLSection(StrictModel):
    """What every RL service must agree on: groups, batch size, staleness, length of the run."""

    mode: Literal["async", "sync"] = "async"
    """`async`: generation runs ahead of training by up to `max_staleness` versions.
    `sync`: staleness 0, generation and training never overlap (the baseline)."""
    max_staleness: int = Field(1, ge=0)
    """With trainer version v, no token generated before version v - max_staleness is trained on."""
    group_size: int = Field(8, ge=1)
    """Responses sampled per prompt (the group of group-relative advantages)."""
    groups_per_step: int = Field(16, ge=1)
    """Prompts (groups) per optimizer step."""
    max_steps: int = Field(100, ge=1)
    """Optimizer steps in the run."""

    @property
    def staleness(self) -> int:
        """The bound in effect: 0 in sync mode."""
        return 0 if self.mode == "sync" else self.max_staleness


class RunSection(StrictModel):
    """What identifies a run and where its outputs go."""

    name: str = "rollwire"
    """Run name, used in logs and output paths."""
    output_dir: Path = Path("runs/default")
    """Run directory: resolved config, logs, checkpoints, the buffer's log."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""


class RunConfig(StrictModel):
    """A whole run: every service reads this file and uses its own section."""

    run: RunSection = RunSection()
    """Identity and outputs of the run."""
    rl: RLSection = RLSection()
    """Settings every RL service shares."""
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
