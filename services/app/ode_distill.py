"""`rollwire ode-distill`: a few-step student of a flow-matching teacher, by ODE trajectory
distillation (`ode_distill` section).

Two phases. **Pairs**: diffusion rollout-servers serving the teacher (one, or
`run.local_rollout_servers`; `endpoints.rollout_servers` when they run elsewhere) sample
its deterministic ODE trajectories, a file of `ode_distill.data_batch` at a time, files
in flight on every server at once; each file is written whole into `ode_distill.data`
(`<run.output_dir>/ode_pairs` when unset), so a stopped run makes only the files it has
not made (`rollwire.diffusion.ode_pairs`), and a folder of other settings is refused.
**Student**: the trainer pipeline (`rollwire.trainer.pipelines.ode_distill`) on
trainer.world_size ranks, which evaluates the student at every `eval_steps` count
against the teacher.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rollwire.services.app.diffusion_teacher import teacher_folder, teacher_servers
from rollwire.services.app.launcher import LaunchError
from rollwire.services.core.config import RunConfig

PAIRS_IN_FLIGHT_PER_SERVER = 2
"""Files asked of each rollout-server at once (one computing, one queued)."""


def pair_settings(config: RunConfig, teacher: Path) -> Any:
    from rollwire.diffusion.ode_pairs import PairSettings, teacher_digest

    ode = config.ode_distill
    return PairSettings(
        teacher=teacher_digest(teacher),
        steps=ode.teacher_steps,
        guidance=ode.guidance,
        shift=ode.shift,
        nodes=tuple(ode.nodes),
        seed=config.run.seed,
        per_file=ode.data_batch,
    )


def pairs_folder(config: RunConfig) -> Path:
    return Path(config.ode_distill.data or Path(config.run.output_dir) / "ode_pairs").resolve()


def make_pairs(config: RunConfig, teacher: Path, folder: Path) -> int:
    """The pairs phase (see the module docstring); returns how many files it made."""
    from rollwire.diffusion.ode_pairs import missing_files, prepare_folder

    settings = pair_settings(config, teacher)
    prepare_folder(folder, settings)
    missing = missing_files(folder, settings, config.ode_distill.pairs)
    if not missing:
        return 0
    work_dir = Path(config.run.output_dir).resolve() / "pairs-logs"
    print(f"teacher: {teacher}\npairs: {len(missing)} files to make into {folder}")
    with teacher_servers(config, teacher, work_dir) as served:
        started = time.perf_counter()
        asyncio.run(_sample(served, settings, folder, missing))
    print(f"{len(missing)} files of teacher trajectories in {time.perf_counter() - started:.0f} s")
    return len(missing)


async def _sample(config: RunConfig, settings: Any, folder: Path, files: list[int]) -> None:
    import numpy as np
    from tqdm import tqdm

    from rollwire.diffusion.ode_pairs import CLASSES, file_trajectories, pair_seed, write_file
    from rollwire.proto.v1 import rollout_pb2
    from rollwire.rollout.orchestrator.servers import Servers
    from rollwire.services.core.wire import array_from_bytes

    servers = Servers(config, eos=-1)
    await servers.wait_until_serving()
    sampling = rollout_pb2.ImageSampling(
        steps=settings.steps,
        eta=0.0,
        sde_first=0,
        sde_last=settings.steps,  # every latent of the ODE, the kept nodes taken from them
        shift=settings.shift,
        guidance=settings.guidance,
    )
    limit = asyncio.Semaphore(PAIRS_IN_FLIGHT_PER_SERVER * len(servers.rollout))
    bar = tqdm(total=len(files), desc="teacher pairs", unit="file", disable=not sys.stderr.isatty())

    async def one(index: int) -> None:
        trajectories = file_trajectories(index, settings, config.ode_distill.pairs)
        labels = [i % CLASSES for i in trajectories]
        seeds = [pair_seed(settings.seed, i) for i in trajectories]
        async with limit:
            samples = await servers.generate_images(
                [str(label) for label in labels], seeds, sampling
            )
        if len(samples) != len(seeds) or any(
            s.finish_reason == rollout_pb2.FINISH_REASON_ABORT for s in samples
        ):
            raise LaunchError(f"the teacher's rollout-server did not finish file {index}")
        paths = np.stack([array_from_bytes(s.latents, "latents") for s in samples])
        write_file(
            folder,
            index,
            paths[:, list(settings.nodes)],
            paths[:, settings.steps],
            np.asarray(labels),
            np.asarray(seeds, np.int64),
        )
        bar.update(1)

    try:
        await asyncio.gather(*(one(index) for index in files))
    finally:
        bar.close()
        await servers.close()


def student_folder(config: RunConfig, teacher: Path) -> Path:
    """Where the student starts: trainer.model_path, a wider built-in digits model
    (`ode_distill.student_channels`, trained once into the cache), else the teacher."""
    channels = config.ode_distill.student_channels
    if channels is None:
        return Path(config.trainer.model_path or teacher)
    if config.trainer.model_path is not None:
        raise ValueError(
            "ode_distill.student_channels builds the student; trainer.model_path names "
            "one too: set one of them"
        )
    if config.ode_distill.teacher_model_path is not None:
        raise ValueError(
            "ode_distill.student_channels builds a student of the built-in digits model: "
            "with another teacher, name a student with trainer.model_path"
        )
    from rollwire.diffusion.digits import DigitsSpec, digits_model

    print(f"student: the built-in digits model with channels {channels} (built once)")
    return digits_model(DigitsSpec(block_out_channels=tuple(channels)), config.trainer.threads)


def run_ode_distill(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire ode-distill` (see the module docstring)."""
    import os

    from rollwire.services.app.run import stop_on_sigterm
    from rollwire.trainer.pipelines.ode_distill import run_student

    try:
        teacher = teacher_folder(config, config.ode_distill.teacher_model_path)
        folder = pairs_folder(config)
        if "RANK" not in os.environ:  # the ranks of a sharded student find the pairs made
            stop_on_sigterm()  # a stopped pairs phase stops the servers it started
            make_pairs(config, teacher, folder)
    except (LaunchError, ValueError, FileNotFoundError) as error:
        print(f"rollwire ode-distill: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        student = student_folder(config, teacher)
    except ValueError as error:
        print(f"rollwire ode-distill: {error}", file=sys.stderr)
        return 1
    ode = config.ode_distill.model_copy(update={"data": folder, "teacher_model_path": teacher})
    trainer = config.trainer.model_copy(update={"model_path": student})
    return run_student(config.model_copy(update={"ode_distill": ode, "trainer": trainer}), argv)
