"""The shared pieces of every section: the base model, and how services listen, call one
another, secure their traffic (TLS, bearer tokens, ZeroMQ CURVE) and log.

Each field's docstring is its help text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
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


def _type_named(value: Any) -> Any:
    return {"type": value} if isinstance(value, str) else value


TYPE_SHORTHAND = BeforeValidator(_type_named)
"""In a union on `type`, a bare name stands for a section of that type with its defaults:
`advantage: rloo` (and `--set trainer.algorithm.advantage=rloo`) is `advantage: {type: rloo}`."""


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
            return read_token_file(self.token_file)
        return None


def read_token_file(path: Path) -> str | None:
    """The first line of `path`, stripped (None if it is empty): a secret kept in a file
    (a mounted Kubernetes secret, a file the launcher wrote)."""
    lines = path.read_text().splitlines()
    return lines[0].strip() if lines and lines[0].strip() else None


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
    reflection: bool = True
    """Offer gRPC server reflection, so grpcurl, grpcui and Postman list and call the
    services without the .proto files (a token, when set, is needed for it too)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics (counters and gauges) at `http://host:PORT/metrics`; 0
    picks a free port (its URL is written to `<ready_file>.metrics`); unset: none."""

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
    trace_exporter: Literal["none", "console", "otlp"] = "none"
    """Where spans go: nowhere, stderr, or an OTLP collector over gRPC (the one
    `OTEL_EXPORTER_OTLP_ENDPOINT` names; with that variable set, `none` means `otlp`).
    Trace context is propagated in call metadata either way."""
    watchdog_seconds: float = Field(300.0, gt=0)
    """Work running longer than this (a group or episode, a generation request, an
    evaluation, the trainer's wait for a batch or its step) is logged as stuck with its
    trace id and counted in `watchdog_stuck`, and again after each further period."""
    trackers: list[Literal["tensorboard", "wandb"]] = ["tensorboard"]
    """Where the trainer's per-step metrics go besides `metrics/trainer.jsonl`:
    `tensorboard` (`<run>/tensorboard`), `wandb` (Weights & Biases, `pip install wandb`;
    its files in `<run>/wandb`). SwanLab is not offered: its releases pin protobuf below
    7, which rollwire's generated code needs."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` needs no network or account (`wandb sync <run>/wandb/offline-run-*`
    uploads later); `online` logs in as the `wandb` tool does (WANDB_API_KEY)."""
    wandb_project: str = "rollwire"
    """The W&B project; the run is named by `run.name`."""
