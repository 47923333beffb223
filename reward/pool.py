"""Scoring in worker processes, each item under a time limit that is really enforced.

Scorers run on the main thread of a worker process, where libraries that time
themselves out with `signal.alarm` (math-verify does) work. A worker that
overruns an item's limit is killed and replaced, so a scorer that loops
forever costs one item and a restart, never the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rollwire.reward.scorers import Score, ScoreInput
from rollwire.services.core.config import SandboxConfig

log = logging.getLogger(__name__)


class ScorerFailed(RuntimeError):
    """The scorer raised; the message carries its exception."""


def _worker_main(
    connection: Connection,
    threads: int,
    custom: dict[str, str],
    sandbox: SandboxConfig | None,
) -> None:
    """Runs scorers on request until the parent closes the pipe."""
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = str(threads)
    from rollwire.reward.scorers import scorer_table

    scorers = scorer_table(custom, sandbox)
    while True:
        try:
            domain, payload = connection.recv()
        except (EOFError, OSError):
            return
        try:
            _, scorer = scorers[domain]
            result: tuple[str, Any] = ("ok", scorer(payload))
        except BaseException as error:  # report everything, including SystemExit from a scorer
            result = ("error", f"{type(error).__name__}: {error}")
        connection.send(result)


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    connection: Connection


class ScoringPool:
    """A fixed number of scorer processes used from asyncio."""

    def __init__(
        self,
        workers: int,
        threads_per_worker: int = 1,
        custom_scorers: dict[str, str] | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        """`sandbox`: the `code` domain's, or None to leave that domain out."""
        self._context = multiprocessing.get_context("spawn")
        self._sandbox = sandbox
        self._threads = threads_per_worker
        self._custom = dict(custom_scorers or {})
        self._idle: asyncio.Queue[_Worker] | None = None
        self._size = workers
        self._all: set[_Worker] = set()
        self._collecting: set[asyncio.Task[None]] = set()  # held so they are not collected
        self.restarts = 0

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child, self._threads, self._custom, self._sandbox),
            daemon=True,
            name="scorer",
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._all.add(worker)
        return worker

    def _queue(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                self._idle.put_nowait(self._spawn())
        return self._idle

    async def score(
        self, domain: str, payload: ScoreInput, timeout: float, queue_timeout: float = 300.0
    ) -> Score:
        """Scores one item. Raises TimeoutError past `timeout`, ScorerFailed if the scorer raised."""
        idle = self._queue()
        worker = await asyncio.wait_for(idle.get(), queue_timeout)
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.connection.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            worker.connection.send((domain, payload))
            await asyncio.wait_for(ready, timeout)
            status, value = worker.connection.recv()
        except (TimeoutError, EOFError, OSError) as error:
            loop.remove_reader(fd)
            self._replace(worker)
            if isinstance(error, TimeoutError):
                raise
            raise ScorerFailed(f"scorer process died: {type(error).__name__}") from None
        except asyncio.CancelledError:
            # The caller went away (its client hung up) while the worker scores: the
            # answer is still coming. Collect it before the worker serves anyone else;
            # dropping the worker here would shrink the pool until nothing scores.
            loop.remove_reader(fd)
            self._collect_later(worker, timeout)
            raise
        loop.remove_reader(fd)
        idle.put_nowait(worker)
        if status == "error":
            raise ScorerFailed(value)
        return value

    def _collect_later(self, worker: _Worker, timeout: float) -> None:
        """Reads and discards the answer `worker` owes, then puts it back to work (or
        replaces it if no answer comes within `timeout`)."""
        loop = asyncio.get_running_loop()

        async def collect() -> None:
            ready = loop.create_future()
            fd = worker.connection.fileno()
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await asyncio.wait_for(ready, timeout)
                worker.connection.recv()
            except (TimeoutError, EOFError, OSError, asyncio.CancelledError):
                loop.remove_reader(fd)
                self._replace(worker)
                return
            loop.remove_reader(fd)
            assert self._idle is not None
            self._idle.put_nowait(worker)

        task = loop.create_task(collect(), name="scorer-collect")
        self._collecting.add(task)
        task.add_done_callback(self._collecting.discard)

    def _replace(self, worker: _Worker) -> None:
        self.restarts += 1
        self._retire(worker)
        assert self._idle is not None
        self._idle.put_nowait(self._spawn())

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.connection.close()
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)

    def close(self) -> None:
        for worker in list(self._all):
            self._retire(worker)
