"""Settings of the pipelines around RL: supervised fine-tuning (`rollwire sft`),
preference tuning (`rollwire dpo`), distillation data (`rollwire distill generate`) and
reward models (`rollwire reward-model`), each a section of the run config by way of
`PipelineSections` (a new pipeline's section is one field there).

The model, backend, ranks, precision, LoRA and optimizer are the `trainer` section's:
every pipeline trains with the same machinery. Imports neither torch nor grpc.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rollwire.services.core.config.names import PreferenceLoss, SupervisedLoss
from rollwire.services.core.config.runtime import StrictModel

HELD_OUT_FRACTION = 0.05
"""The default share of a pipeline's data held out. A config is validated with every
default filled in, so `eval_data` beside another fraction is what says both."""


class PipelineData(StrictModel):
    """What every pipeline that steps through a data file has: the file, its held-out
    part, the epochs, steps, checkpoints and seed (`rollwire.trainer.pipelines.common`)."""

    section: ClassVar[str] = ""
    """The section's name in the run config, for messages."""

    data: Path | None = None
    """The training rows: a .jsonl or .parquet file, or a `save_to_disk` folder."""
    eval_data: Path | None = None
    """Held-out rows; unset holds out `held_out_fraction` of `data` instead."""
    held_out_fraction: float = Field(HELD_OUT_FRACTION, ge=0, lt=1)
    """Share of `data` held out for the held-out metrics when `eval_data` is unset."""
    epochs: int = Field(1, ge=1)
    """Passes over the training rows (each in a new seeded order)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps, before the epochs are done."""
    checkpoint_every: int = Field(0, ge=0)
    """Steps between checkpoints (model, optimizer, schedule; a restarted run resumes
    from the newest); 0 writes only the final model."""
    seed: int = 0
    """Seed of the held-out split and of every epoch's order."""

    @model_validator(mode="after")
    def _eval_source(self) -> PipelineData:
        if self.eval_data is not None and self.held_out_fraction != HELD_OUT_FRACTION:
            raise ValueError(
                f"{self.section}.eval_data and {self.section}.held_out_fraction both say "
                "where the held-out rows come from; set one"
            )
        return self


class SFTConfig(PipelineData):
    """`rollwire sft`: supervised fine-tuning of trainer.model_path on a dataset file of
    chat `messages` or `prompt`/`completion` rows, the loss on the assistant's tokens."""

    section: ClassVar[str] = "sft"

    max_length: int = Field(1024, ge=2)
    """Tokens per example; longer ones are cut (or left out when `truncate` is off)."""
    truncate: bool = True
    """Cut examples longer than max_length (the loss on what is left) instead of
    leaving them out; either way the counts are reported."""
    chat_template: bool | None = None
    """Render with the tokenizer's chat template; unset: when it has one. Without, the
    contents are concatenated with the end-of-sequence token after the last answer."""
    loss: SupervisedLoss = "nll"
    """`nll`: the negative log-likelihood of the rows' tokens. `forward_kl` and
    `reverse_kl`: token-level distillation, a KL to the teacher's top-k distribution at
    every completion token (`rollwire.trainer.math.losses.DISTILL_LOSSES`), from rows `rollwire
    distill generate` wrote with distill.top_k set."""
    packing: bool = False
    """Pack each step's examples into rows of up to max_length tokens, each example
    attending only to itself (block-diagonal attention, positions from 0 each): far
    fewer padding tokens when examples are short; the loss is the same."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step (trainer.batching.micro_batch_size or
    trainer.batching.max_tokens_per_micro_batch cut it into passes)."""
    eval_every: int = Field(50, ge=0)
    """Steps between evaluation losses on the held-out rows (and one at the end); 0:
    only at the end."""


class DPOConfig(PipelineData):
    """`rollwire dpo`: preference tuning of trainer.model_path on `prompt`/`chosen`/
    `rejected` rows (strings or message lists) against itself as it starts (the frozen
    reference, whose logprobs are computed once per pair, before the first update)."""

    section: ClassVar[str] = "dpo"

    loss: PreferenceLoss = "dpo"
    """`dpo`: -log sigmoid(beta h); `ipo`: (h - 1 / 2 beta)^2; `simpo`: length-normalised,
    with margin `gamma` and no reference (h: the chosen's log-ratio to the reference
    minus the rejected's)."""
    beta: float = Field(0.1, gt=0)
    """The loss's temperature (SimPO's paper uses 2 to 2.5)."""
    gamma: float = Field(0.5, ge=0)
    """SimPO's target margin (ignored by dpo and ipo)."""
    sft_weight: float = Field(0.0, ge=0)
    """Add this times the chosen response's token-mean negative log-likelihood to each
    pair's loss (RPO): keeps the chosen answers likely while the pair's margin grows;
    without it DPO may push both down until greedy decoding breaks."""
    max_length: int = Field(1024, ge=2)
    """Tokens of prompt plus response; a longer pair is cut (or left out)."""
    truncate: bool = True
    """Cut pairs longer than max_length instead of leaving them out."""
    chat_template: bool | None = None
    """Render with the tokenizer's chat template; unset: when it has one."""
    batch_size: int = Field(16, ge=1)
    """Pairs per optimizer step."""
    eval_every: int = Field(25, ge=0)
    """Steps between held-out evaluations (and one at the end); 0: only at the end."""


class DistillConfig(StrictModel):
    """Distillation. `rollwire distill generate` writes sequence- and token-level data:
    the teacher, a rollout-server started on teacher_model_path (else on
    trainer.model_path; any rollout_server.engine), answers the training prompts of
    orchestrator.dataset (the evaluation set's left out) at rl.temperature, the
    reward-server scores each answer, and the kept ones are written as
    `prompt`/`completion` rows (with top_k, the teacher's top-k per token too) that
    `rollwire sft` trains a student on. On-policy distillation (`trainer.algorithm.advantage:
    on_policy_distill` in `rollwire train`) serves teacher_model_path to score the
    student's samples."""

    prompts: int = Field(1000, ge=1)
    """How many training prompts the teacher answers."""
    samples: int = Field(1, ge=1)
    """Answers per prompt."""
    min_reward: float | None = None
    """Keep only answers scored at least this (rejection sampling); unset keeps all."""
    top_k: int = Field(0, ge=0, le=64)
    """Token-level distillation data: also record, for every answer token, the
    teacher's top_k most likely tokens and their logprobs (RolloutService.ScoreTokens),
    with the token ids, for `rollwire sft` with sft.loss forward_kl or reverse_kl; 0
    writes text rows only."""
    output: Path | None = None
    """The rows' file; `<run.output_dir>/distill.jsonl` when unset."""
    teacher_model_path: Path | None = None
    """The teacher, a Hugging Face folder whose tokenizer is the student's. `rollwire
    distill generate` answers with it (trainer.model_path when unset); on-policy
    distillation's `rollwire train` serves it on a rollout-server of its own
    (`teacher_engine`) unless endpoints.teacher_servers names running ones."""
    teacher_engine: Literal["hf", "vllm"] = "hf"
    """The engine of the teacher rollout-server `rollwire train` starts (the engines that
    score given tokens)."""


class RewardModelTrainingConfig(PipelineData):
    """`rollwire reward-model`: a Bradley-Terry reward model (trainer.model_path's body
    with a one-output head) trained on `prompt`/`chosen`/`rejected` rows of strings, for
    the reward-server's `reward_model` domain (reward_server.reward_model.model_path:
    `<run.output_dir>/final`). A row's `prompt` is what the reward-server will hand the
    model: a task's question (`ScoreItem.prompt`), not the prompt the policy is shown."""

    section: ClassVar[str] = "reward_model"

    chat: bool = True
    """Render each prompt and response as a user and an assistant turn with the
    tokenizer's chat template (when it has one); False joins the two strings. Serve the
    model with the same reward_server.reward_model.chat."""
    max_length: int = Field(1024, ge=8)
    """Tokens per text; longer ones keep their end (the response), as the
    reward-server's reward_model.max_length does."""
    batch_size: int = Field(16, ge=1)
    """Pairs per optimizer step."""
    eval_every: int = Field(25, ge=0)
    """Steps between held-out evaluations (and one at the end); 0: only at the end."""


DIFFERENTIABLE_DOMAINS = ("digit", "brightness", "contrast", "colour")
"""The image domains whose scorer has a differentiable twin (`rollwire.diffusion.
differentiable`): what reward feedback learning can maximise."""


class RewardFLConfig(StrictModel):
    """Reward feedback learning for a diffusion model (`rollwire train` with
    `reward_fl.enabled`; the pipeline table's `reward_fl`): the rollout-server samples
    each image by the ODE and keeps the latent `grad_steps` steps before the end; the
    trainer runs those last steps again with gradients, scores the image they make with
    the differentiable twin of the dataset's domain and ascends that reward, with
    `trainer.algorithm.kl.coef` times the squared distance of its velocities to the
    starting model's on the same steps. `orchestrator.images.steps` is the sampling's
    length; its `eta` and `sde_window` are Flow-GRPO's and do not apply."""

    enabled: bool = False
    """Train by reward feedback learning instead of Flow-GRPO."""
    grad_steps: int = Field(2, ge=1)
    """The last denoising steps the reward's gradient flows back through (K)."""


class StudentEvaluation(StrictModel):
    """What the distillation pipelines share: the teacher, and how the student's samples
    are measured at every evaluation (`rollwire.trainer.pipelines.student_quality`)."""

    section: ClassVar[str] = ""
    teacher_model_path: Path | None = None
    """The teacher's folder; the built-in digits model when unset."""
    eval_steps: list[int] = [1, 2, 4]
    """The student's sampling steps measured at each evaluation."""
    eval_per_class: int = Field(200, ge=2)
    """Evaluation samples of each class (held-out seeds, the same every time). The
    Frechet distance of few samples reads high for everyone alike, which hides a gap:
    the teacher reads 0.36 at 200 a class and 0.93 at 50, where a student's 1.48x at 200
    reads 1.14x."""

    @model_validator(mode="after")
    def _measurable(self) -> StudentEvaluation:
        if not self.eval_steps or min(self.eval_steps) < 1:
            raise ValueError(f"{self.section}.eval_steps must be 1 or more, got {self.eval_steps}")
        return self


class ODEDistillConfig(PipelineData, StudentEvaluation):
    """`rollwire ode-distill`: a few-step student of a flow-matching teacher, by ODE
    trajectory distillation. The teacher (teacher_model_path, else the built-in digits
    model), served by diffusion rollout-servers, samples `pairs` deterministic ODE
    trajectories of `teacher_steps` steps, one per (class, seed); the latents at the grid
    indices `nodes` and the final sample are kept in `data` (resumable: pairs already
    there are not made again). The student (trainer.model_path, else the teacher) learns
    to predict, from a node's latent and time, the teacher's final sample in one step
    (mean squared error), on the trainer section's backend, LoRA and optimizer. Every
    evaluation samples it at each of `eval_steps` steps and measures the samples with the
    digits judge against the teacher's at `teacher_steps`."""

    section: ClassVar[str] = "ode_distill"
    pairs: int = Field(2000, ge=1)
    """Teacher trajectories to make (and train on)."""
    teacher_steps: int = Field(48, ge=2)
    """The teacher's ODE steps from noise to data."""
    guidance: float = Field(1.0, ge=0)
    """The teacher's classifier-free guidance (1: none)."""
    shift: float = Field(1.0, gt=0)
    """The teacher grid's time shift (1: uniform)."""
    nodes: list[int] = [0, 12, 24, 36]
    """Grid indices whose latents are kept and trained on (0: the noise at t = 1)."""
    train_nodes: list[int] | None = None
    """Of `nodes`, those the student trains on (and is held-out-scored on); unset: all.
    [0] spends the whole student on the one-step jump from noise, without making the
    pairs again."""
    student_channels: list[int] | None = None
    """A student wider than the built-in teacher: the built-in digits model with these
    block channels (the teacher's are [16, 32]), trained once by flow matching on the
    digits (cached, as the teacher is) and distilled from there instead of from a copy
    of the teacher. Each a multiple of 8; unset: trainer.model_path, else the teacher."""
    renoise: Literal["fresh", "ddim"] = "fresh"
    """How the student's few-step sampling takes a clean prediction to the next time:
    with fresh noise, or with the noise the step implies (the ODE's Euler step)."""
    feature_weight: float = Field(0.0, ge=0)
    """Weight of a perceptual distance beside the squared error: the student's prediction
    and the teacher's sample compared in the frozen teacher's own activations (its down
    blocks' and middle block's maps of the clean images, each unit-scaled over channels,
    as LPIPS does; `diffusion.distill.feature_distance`). The teacher then also runs in
    the trainer (0.14 s a step of 64 against 0.11 s for the [48, 96] student on two
    threads). 0: the squared error alone."""
    batch_size: int = Field(64, ge=1)
    """(node latent, final sample) rows per step."""
    eval_every: int = Field(200, ge=0)
    """Steps between evaluations (also before the first and after the last); 0: those two."""
    data_batch: int = Field(256, ge=1)
    """Trajectories a rollout-server is asked for at once (one file of `data` each)."""
    ema_decay: float | None = Field(None, gt=0, lt=1)
    """An exponential moving average of the student's weights with this decay, saved
    beside it (`final_ema`) and evaluated in its place; unset: none."""

    @model_validator(mode="after")
    def _fits(self) -> ODEDistillConfig:
        bad = [node for node in self.nodes if not 0 <= node < self.teacher_steps]
        if not self.nodes or bad:
            raise ValueError(
                f"ode_distill.nodes must be grid indices in [0, {self.teacher_steps}) "
                f"(0 is the noise at t = 1), got {self.nodes}"
            )
        if sorted(set(self.nodes)) != self.nodes:
            raise ValueError(f"ode_distill.nodes must increase without repeats, got {self.nodes}")
        channels = self.student_channels
        if channels is not None and (
            not 1 <= len(channels) <= 4 or any(c <= 0 or c % 8 for c in channels)
        ):
            raise ValueError(
                "ode_distill.student_channels must be 1 to 4 block widths, each a multiple of "
                f"8 (the model's group norm has 8 groups), e.g. [32, 64]; got {channels}"
            )
        if self.train_nodes is not None and (
            not self.train_nodes or not set(self.train_nodes) <= set(self.nodes)
        ):
            raise ValueError(
                f"ode_distill.train_nodes must be some of ode_distill.nodes {self.nodes}, "
                f"got {self.train_nodes}"
            )
        return self


class DMDConfig(StudentEvaluation):
    """`rollwire dmd`: a one- or few-step generator distilled from a flow-matching teacher
    by distribution matching (DMD, with DMD2's options). The frozen teacher (the real
    score) is served by diffusion rollout-servers (`Denoise`); the generator
    (trainer.model_path, else the teacher) and the fake score (the teacher to start, a
    denoiser trained on the generator's samples) train in the trainer. A step is
    `fake_updates` updates of the fake score, then one of the generator. Every
    evaluation samples the generator (its EMA when `ema_decay` is set) at each of
    `eval_steps` steps and measures the samples with the digits judge against the
    teacher's at `teacher_steps`."""

    section: ClassVar[str] = "dmd"
    steps: int = Field(1000, ge=1)
    """Generator updates."""
    batch_size: int = Field(64, ge=1)
    """Generated samples per update, of the generator and of the fake score alike."""
    fake_updates: int = Field(5, ge=1)
    """Fake-score updates per generator update (the two-time-scale rule)."""
    fake_learning_rate: float | None = Field(None, gt=0)
    """The fake score's learning rate (same optimizer settings and schedule otherwise);
    unset: trainer.optimizer.learning_rate."""
    guidance: float = Field(1.0, ge=1)
    """The real score's classifier-free guidance (1: none)."""
    time_range: tuple[float, float] = (0.02, 0.98)
    """The noise levels t the generated samples are diffused to, uniform in this range,
    for both scores."""
    student_steps: int | list[int] = 1
    """The generator's own sampling schedule (`diffusion.distill.student_times`): above 1
    every update trains one of its steps, chosen at random, on the input the generator's
    earlier steps make (backward simulation). A list, e.g. [1, 2, 4], trains each of
    those schedules (one chosen at random per batch): the generator then samples as well
    in each of those step counts."""

    @field_validator("student_steps")
    @classmethod
    def _schedules_take_steps(cls, value: int | list[int]) -> int | list[int]:
        counts = [value] if isinstance(value, int) else value
        if not counts or min(counts) < 1:
            raise ValueError(f"student_steps needs step counts of at least 1, got {value}")
        return value

    def schedules(self) -> list[int]:
        """`student_steps` as a list of step counts."""
        steps = self.student_steps
        return [steps] if isinstance(steps, int) else list(steps)

    renoise: Literal["fresh", "ddim"] = "fresh"
    """How few-step sampling, in training and evaluation, takes a clean prediction to
    the next time: fresh noise, or the noise the step implies."""
    gan_weight: float = Field(0.0, ge=0)
    """DMD2's GAN term: a head on the fake score's middle features learns to tell real
    training digits from generated samples (both diffused to t), and the generator's
    loss adds this times its non-saturating loss on the head. 0: off."""
    gan_learning_rate: float = Field(1e-3, gt=0)
    """The GAN head's learning rate."""
    ema_decay: float | None = Field(None, gt=0, lt=1)
    """An exponential moving average of the generator's weights with this decay, saved
    beside it (`final_ema`) and evaluated in its place; unset: none."""
    teacher_steps: int = Field(48, ge=2)
    """The teacher's ODE steps for the quality reference."""
    eval_every: int = Field(100, ge=0)
    """Steps between evaluations (also before the first and after the last); 0: those two."""
    checkpoint_every: int = Field(0, ge=0)
    """Steps between checkpoints (both models, both optimizers, the GAN head, the EMA;
    a restarted run resumes from the newest); 0 writes only the final models."""

    @model_validator(mode="after")
    def _fits(self) -> DMDConfig:
        low, high = self.time_range
        if not 0 < low < high <= 1:
            raise ValueError(f"dmd.time_range must satisfy 0 < low < high <= 1, got {low}, {high}")
        return self


class PipelineSections(StrictModel):
    """The pipelines' sections of the run config (`RunConfig` has them all)."""

    sft: SFTConfig = SFTConfig()
    """`rollwire sft`: supervised fine-tuning with the trainer section's model, backend
    and optimizer."""
    dpo: DPOConfig = DPOConfig()
    """`rollwire dpo`: preference tuning with the trainer section's model, backend and
    optimizer."""
    distill: DistillConfig = DistillConfig()
    """`rollwire distill generate`: a teacher's answers as rows for `rollwire sft`."""
    reward_model: RewardModelTrainingConfig = RewardModelTrainingConfig()
    """`rollwire reward-model`: a reward model for the reward-server, with the trainer
    section's backend and optimizer."""
    ode_distill: ODEDistillConfig = ODEDistillConfig()
    """`rollwire ode-distill`: a few-step student of a diffusion teacher, by ODE
    trajectory distillation through diffusion rollout-servers."""
    dmd: DMDConfig = DMDConfig()
    """`rollwire dmd`: a few-step generator distilled from a diffusion teacher by
    distribution matching, the teacher served by diffusion rollout-servers."""
    reward_fl: RewardFLConfig = RewardFLConfig()
    """Reward feedback learning for a diffusion run (`rollwire train` with
    `rollout_server.engine: diffusion`), instead of Flow-GRPO."""
