"""A diffusion teacher served by rollout-servers, for the distillation commands
(`rollwire ode-distill`, `rollwire dmd`): the built-in digits model when no folder is
given, and `teacher_servers`, which starts diffusion rollout-servers on it (one, or
`run.local_rollout_servers`) unless `endpoints.rollout_servers` names running ones, and
stops what it started."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rollwire.services.app.launcher import Stack, start_servers, thread_budget
from rollwire.services.core.config import RunConfig, write_resolved_config


def teacher_folder(config: RunConfig, setting: Path | None) -> Path:
    """`setting` (a section's teacher_model_path), or the built-in digits model (built
    once into the cache)."""
    if setting is not None:
        return Path(setting)
    from rollwire.diffusion.digits import digits_model

    return digits_model(threads=config.trainer.threads)


@contextlib.contextmanager
def teacher_servers(config: RunConfig, teacher: Path, work_dir: Path) -> Iterator[RunConfig]:
    """The run config of rollout-servers serving `teacher` with the diffusion engine
    (started here, logging into `work_dir`, and stopped on leaving), or of those that
    `endpoints.rollout_servers` names."""
    served = RunConfig.model_validate(
        {
            **config.model_dump(mode="json", exclude_unset=True),
            "run": {**config.run.model_dump(mode="json"), "output_dir": str(work_dir)},
            "rollout_server": {
                **config.rollout_server.model_dump(mode="json"),
                "engine": "diffusion",
                "model_path": str(teacher),
            },
            # A diffusion engine's run samples image prompts.
            "orchestrator": {
                **config.orchestrator.model_dump(mode="json", exclude_unset=True),
                "dataset": {"type": "images"},
                "eval_dataset": None,
            },
        }
    )
    if config.endpoints.rollout_servers:
        yield served
        return
    stack = Stack(work_dir, write_resolved_config(served, work_dir), thread_budget(served))
    try:
        yield start_servers(served, stack, services=("rollout-server",))
    finally:
        stack.stop()
