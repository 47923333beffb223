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
from typing import TYPE_CHECKING, Any

from rollwire.reward.scorers import Score, ScoreInput

if TYPE_CHECKING:
    from rollwire.services.core.config import SandboxConfig

log = logging.getLogger(__name__)


STARTUP_TIMEOUT_SECONDS = 120.0
"""How long a new scorer worker may take to import its scorers."""
MAX_ERROR_CHARS = 500
"""Longest scorer error message passed on (to the caller and the log)."""


class ScorerFailed(RuntimeError):
    """The scorer raised; the message carries its exception."""


def _worker_main(
    connection: Connection,
    threads: int,
    custom: dict[str, str],
    sandbox: dict[str, Any] | None,
) -> None:
    """Runs scorers on request until the parent closes the pipe."""
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = str(threads)
    from rollwire.reward.table import scorer_table
    from rollwire.services.core.config import SandboxConfig

    scorers = scorer_table(custom, SandboxConfig(**sandbox) if sandbox is not None else None)
    connection.send(("ready", None))  # imports done: from here an item's time is its own
    while True:
        try:
            domain, payload = connection.recv()
        except (EOFError, OSError):
            return
        try:
            _, scorer = scorers[domain]
            result: tuple[str, Any] = ("ok", scorer(payload))
        except BaseException as error:  # report everything, including SystemExit from a scorer
            # Bounded: an exception's text may hold the whole input.
            result = ("error", f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS])
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
        self.waiting = 0
        """Items waiting for a worker to come free (the load an autoscaler reads)."""
        self._closed = False

    def _spawn(self) -> None:
        """Starts a worker; it joins the idle queue once it says it is ready, so the time
        its imports take (seconds, on a busy machine) is never charged to an item."""
        if self._closed:
            return
        parent, child = self._context.Pipe()
        sandbox = None if self._sandbox is None else self._sandbox.model_dump()
        process = self._context.Process(
            target=_worker_main,
            args=(child, self._threads, self._custom, sandbox),
            daemon=True,
            name="scorer",
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._all.add(worker)
        task = asyncio.get_running_loop().create_task(self._when_ready(worker), name="scorer-start")
        self._collecting.add(task)
        task.add_done_callback(self._collecting.discard)

    async def _when_ready(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.connection.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, STARTUP_TIMEOUT_SECONDS)
            status, _ = worker.connection.recv()
            if status != "ready":
                raise EOFError(status)
        except (TimeoutError, EOFError, OSError) as error:
            loop.remove_reader(fd)
            log.warning(
                "a scorer worker did not start (%s); starting another", type(error).__name__
            )
            self._retire(worker)
            self.restarts += 1
            await asyncio.sleep(1.0)  # a worker that cannot start must not spin
            if not self._closed:
                self._spawn()
            return
        except asyncio.CancelledError:
            loop.remove_reader(fd)
            raise
        loop.remove_reader(fd)
        assert self._idle is not None
        self._idle.put_nowait(worker)

    def idle_workers(self) -> int:
        """Workers started, ready and not scoring."""
        return 0 if self._idle is None else self._idle.qsize()

    def _queue(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                self._spawn()
        return self._idle

    async def score(
        self,
        domain: str,
        payload: ScoreInput,
        timeout: float,
        queue_timeout: float = 300.0,
        deadline: float | None = None,
    ) -> Score:
        """Scores one item. Raises TimeoutError past `timeout`, or when the event loop's
        clock reaches `deadline` (waiting for a worker included), ScorerFailed if the
        scorer raised."""
        idle = self._queue()
        loop = asyncio.get_running_loop()
        if deadline is not None:
            queue_timeout = min(queue_timeout, deadline - loop.time())
        if queue_timeout <= 0:
            raise TimeoutError("no time was left for this item within the call's deadline")
        self.waiting += 1
        try:
            worker = await asyncio.wait_for(idle.get(), queue_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"no scorer worker came free within {queue_timeout:.3g}s (all {self._size} busy)"
            ) from None
        finally:
            self.waiting -= 1
        item_ends = loop.time() + timeout
        cut = deadline is not None and deadline < item_ends
        if cut:
            timeout = deadline - loop.time()
            if timeout <= 0:
                idle.put_nowait(worker)
                raise TimeoutError("no time was left for this item within the call's deadline")
        ready = loop.create_future()
        fd = worker.connection.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            worker.connection.send((domain, payload))
            await asyncio.wait_for(ready, timeout)
            status, value = worker.connection.recv()
        except TimeoutError:
            loop.remove_reader(fd)
            if cut:
                # The call's deadline, not the item's limit: the worker may still finish
                # within the latter, so collect its answer rather than kill it.
                self._collect_later(worker, max(0.0, item_ends - loop.time()))
                raise TimeoutError(
                    f"the call's deadline came {timeout:.3g}s into scoring this item"
                ) from None
            self._replace(worker)
            raise TimeoutError(f"scorer timed out after {timeout:.3g}s") from None
        except (EOFError, OSError) as error:
            loop.remove_reader(fd)
            self._replace(worker)
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
        self._spawn()

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.connection.close()
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)

    def close(self) -> None:
        self._closed = True
        for task in list(self._collecting):
            task.cancel()
        for worker in list(self._all):
            self._retire(worker)
