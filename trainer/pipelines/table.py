"""Every pipeline rollwire runs, one entry each: its command, the config section it reads,
the data it trains on, its step, the model family it trains, the services it needs and
the program that runs it.

The CLI makes its commands from this table, `rollwire train`/`up` start the services of
the run's pipeline (`pipeline_of`), and a new pipeline is one entry here plus its
program (and its config section in services/core/config/pipelines.py). Imports neither
torch nor grpc: the CLI reads it to build its help.

Every program has one shape: `program(config: RunConfig) -> int` (an exit code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RL_SERVICES = ("reward-server", "rollout-server", "buffer", "orchestrator", "trainer")
"""What an RL run starts (and env-servers for an `env` dataset)."""

SAMPLING_SERVICES = ("reward-server", "rollout-server")
"""What sampling and scoring alone needs (`rollwire eval`, `rollwire distill generate`)."""


@dataclass(frozen=True)
class Pipeline:
    """One pipeline (see the module docstring). `services` empty: it runs alone, as one
    program (on trainer.world_size ranks), and is a command of its own."""

    name: str
    """The command (`rollwire <name>`), or for RL the pipeline `rollwire train` runs."""
    section: str
    """The RunConfig section of its settings."""
    data: str
    """What it trains on."""
    step: str
    """Its step, `module:Class` (empty for one that only samples)."""
    family: str
    """The model family it trains, `module:Class` (`rollwire.trainer.models`)."""
    services: tuple[str, ...]
    """The services it needs running."""
    program: str
    """`module:function` that runs it: `function(config) -> exit code`."""
    help: str
    """One line for the CLI's help."""


CAUSAL_LM = "rollwire.trainer.models.causal_lm:CausalLM"

PIPELINES: dict[str, Pipeline] = {
    "rl": Pipeline(
        name="rl",
        section="rl",
        data="prompts of orchestrator.dataset (or env episodes), sampled and scored live",
        step="rollwire.trainer.rl.step:RLStep",
        family=CAUSAL_LM,
        services=RL_SERVICES,
        program="rollwire.services.app.run:run_train",
        help="RL on live rollouts (rollwire train, rollwire up)",
    ),
    "on_policy_distill": Pipeline(
        name="on_policy_distill",
        section="distill",
        data="the student's own samples, each token scored by a teacher rollout-server",
        step="rollwire.trainer.rl.step:RLStep",
        family=CAUSAL_LM,
        services=(*RL_SERVICES, "teacher-server"),
        program="rollwire.services.app.run:run_train",
        help="on-policy distillation (rollwire train with trainer.algorithm.advantage on_policy_distill)",
    ),
    "flow_grpo": Pipeline(
        name="flow_grpo",
        section="rl",
        data="image prompts of orchestrator.dataset (type images), sampled by a diffusion "
        "rollout-server's SDE and scored live",
        step="rollwire.trainer.rl.flow_grpo:FlowGRPOStep",
        family="rollwire.trainer.models.flow_denoiser:FlowDenoiser",
        services=RL_SERVICES,
        program="rollwire.services.app.run:run_train",
        help="Flow-GRPO: RL for a flow-matching diffusion model (rollwire train with "
        "rollout_server.engine diffusion)",
    ),
    "reward_fl": Pipeline(
        name="reward_fl",
        section="reward_fl",
        data="image prompts of orchestrator.dataset (type images), sampled by a diffusion "
        "rollout-server's ODE to its last reward_fl.grad_steps steps",
        step="rollwire.trainer.rl.reward_fl:RewardFLStep",
        family="rollwire.trainer.models.flow_denoiser:FlowDenoiser",
        services=RL_SERVICES,
        program="rollwire.services.app.run:run_train",
        help="reward feedback learning for a flow-matching diffusion model (rollwire train "
        "with reward_fl.enabled)",
    ),
    "sft": Pipeline(
        name="sft",
        section="sft",
        data="chat `messages` or `prompt`/`completion` rows (or a teacher's top-k rows)",
        step="rollwire.trainer.pipelines.steps:SupervisedStep",
        family=CAUSAL_LM,
        services=(),
        program="rollwire.trainer.pipelines.sft:run_sft",
        help="supervised fine-tuning of trainer.model_path on sft.data (messages or "
        "prompt/completion rows), the loss on the assistant's tokens",
    ),
    "dpo": Pipeline(
        name="dpo",
        section="dpo",
        data="`prompt`/`chosen`/`rejected` rows",
        step="rollwire.trainer.pipelines.steps:PreferenceStep",
        family=CAUSAL_LM,
        services=(),
        program="rollwire.trainer.pipelines.dpo:run_dpo",
        help="preference tuning (DPO, IPO, SimPO) of trainer.model_path on dpo.data "
        "(prompt/chosen/rejected rows)",
    ),
    "distill": Pipeline(
        name="distill",
        section="distill",
        data="training prompts of orchestrator.dataset, answered by a teacher",
        step="",
        family=CAUSAL_LM,
        services=SAMPLING_SERVICES,
        program="rollwire.services.app.run:run_distill_generate",
        help="distillation: `generate` writes a teacher's scored answers as rows for sft",
    ),
    "ode-distill": Pipeline(
        name="ode-distill",
        section="ode_distill",
        data="a diffusion teacher's ODE trajectories (their nodes and ends), which the "
        "command has its own diffusion rollout-servers sample first (resumable)",
        step="rollwire.trainer.pipelines.ode_distill:ODEDistillStep",
        family="rollwire.trainer.models.flow_denoiser:FlowDenoiser",
        services=(),
        program="rollwire.services.app.ode_distill:run_ode_distill",
        help="ODE trajectory distillation of a diffusion teacher (ode_distill.teacher_model_path, "
        "else the built-in digits model) into a few-step student",
    ),
    "dmd": Pipeline(
        name="dmd",
        section="dmd",
        data="the generator's own samples, scored by a served teacher (Denoise on diffusion "
        "rollout-servers) and by a fake score trained on them",
        step="rollwire.trainer.pipelines.dmd:DMDStep",
        family="rollwire.trainer.models.flow_denoiser:FlowDenoiser",
        services=(),
        program="rollwire.services.app.dmd:run_dmd",
        help="distribution-matching distillation (DMD, DMD2) of a diffusion teacher "
        "(dmd.teacher_model_path, else the built-in digits model) into a few-step generator",
    ),
    "reward-model": Pipeline(
        name="reward-model",
        section="reward_model",
        data="`prompt`/`chosen`/`rejected` rows (strings)",
        step="rollwire.trainer.pipelines.reward_model:RewardModelStep",
        family="rollwire.trainer.models.sequence_score:SequenceScore",
        services=(),
        program="rollwire.trainer.pipelines.reward_model:run_reward_model",
        help="train a Bradley-Terry reward model on reward_model.data (prompt/chosen/"
        "rejected rows) for the reward-server's reward_model domain",
    ),
}


def offline() -> list[Pipeline]:
    """The pipelines that run alone, as commands of their own (`rollwire sft`, ...)."""
    return [pipeline for pipeline in PIPELINES.values() if not pipeline.services]


def pipeline_of(config: Any) -> Pipeline:
    """The pipeline `rollwire train` runs for `config`: for a diffusion rollout-server
    reward feedback learning when `reward_fl.enabled`, else Flow-GRPO; on-policy
    distillation when the trainer's advantage is the teacher's; else RL."""
    if config.rollout_server.engine == "diffusion":
        return PIPELINES["reward_fl" if config.reward_fl.enabled else "flow_grpo"]
    if config.trainer.algorithm.advantage.type == "on_policy_distill":
        return PIPELINES["on_policy_distill"]
    return PIPELINES["rl"]


def load(spec: str) -> Any:
    """The object a `module:name` string names, imported now."""
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
