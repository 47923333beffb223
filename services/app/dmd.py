"""`rollwire dmd`: a one- or few-step generator distilled from a flow-matching teacher by
distribution matching (`dmd` section).

The teacher is served, not loaded: diffusion rollout-servers on it (one, or
`run.local_rollout_servers`; `endpoints.rollout_servers` when they run elsewhere, shared
by any number of trainers) answer the trainer's `Denoise` calls with its clean
predictions (the real score, with `dmd.guidance`). The generator and the fake score train
in this process (`rollwire.trainer.pipelines.dmd`, whose docstring says why).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from rollwire.services.app.diffusion_teacher import teacher_folder, teacher_servers
from rollwire.services.app.launcher import LaunchError
from rollwire.services.core.config import RunConfig

CALL_SECONDS = 600.0
"""The longest a `Denoise` call may take, its retries included, before the run stops
with an error (a server that stopped answering must not hang the trainer)."""


class RealScore:
    """The teacher's clean predictions through its rollout-servers: a callable for the
    trainer's loop, which is synchronous, over the asynchronous client (`Servers`) on an
    event loop of its own thread; calls are spread over the servers in turn."""

    def __init__(self, config: RunConfig, guidance: float) -> None:
        from rollwire.rollout.orchestrator.servers import Servers

        self.guidance = guidance
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="real-score", daemon=True)
        self.thread.start()

        async def connect() -> Any:
            servers = Servers(config, eos=-1)
            await servers.wait_until_serving()
            return servers

        self.servers = self._wait(connect(), config.client.connect_timeout_seconds + 30)

    def _wait(self, coroutine: Any, seconds: float) -> Any:
        import grpc

        from rollwire.services.core.client import describe_error

        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=seconds)
        except TimeoutError:
            future.cancel()
            raise LaunchError(
                f"the teacher's rollout-servers did not answer in {seconds:.0f} s"
            ) from None
        except grpc.RpcError as error:
            raise LaunchError(f"the teacher's rollout-server: {describe_error(error)}") from None

    def __call__(self, latents: np.ndarray, times: list[float], labels: list[int]) -> np.ndarray:
        return self._wait(self.servers.denoise(latents, times, labels, self.guidance), CALL_SECONDS)

    def close(self) -> None:
        if getattr(self, "servers", None) is not None:
            self._wait(self.servers.close(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def run_dmd(config: RunConfig, argv: list[str] | None = None) -> int:
    """`rollwire dmd` (see the module docstring)."""
    from rollwire.services.app.run import stop_on_sigterm
    from rollwire.trainer.pipelines.dmd import run_generator

    if config.trainer.backend != "local" or config.trainer.world_size != 1:
        print(
            "rollwire dmd: the generator and the fake score train together in one process: "
            "trainer.backend must be local and trainer.world_size 1 (the teacher scales "
            "apart, as rollout-servers)",
            file=sys.stderr,
        )
        return 1
    start = config.trainer.model_path
    if start is not None and not (Path(start) / "config.json").exists():
        print(
            f"rollwire dmd: trainer.model_path {start} is no model folder: make the starting "
            "student first (rollwire ode-distill -c examples/diffusion_ode_distill.yaml "
            "writes runs/ode_distill/final), or unset trainer.model_path to start the "
            "generator from the teacher",
            file=sys.stderr,
        )
        return 1
    stop_on_sigterm()  # a stopped run stops the teacher's servers it started
    real_score = None
    try:
        teacher = teacher_folder(config, config.dmd.teacher_model_path)
        work_dir = Path(config.run.output_dir).resolve() / "teacher-logs"
        print(f"teacher: {teacher} (served for the real score)")
        with teacher_servers(config, teacher, work_dir) as served:
            real_score = RealScore(served, config.dmd.guidance)
            dmd = config.dmd.model_copy(update={"teacher_model_path": teacher})
            return run_generator(config.model_copy(update={"dmd": dmd}), teacher, real_score)
    except (LaunchError, ValueError, FileNotFoundError) as error:
        print(f"rollwire dmd: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if real_score is not None:
            real_score.close()
