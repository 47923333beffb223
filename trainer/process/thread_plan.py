"""The machine-wide thread plan of a local run: how many CPU threads the trainer and the
rollout-server compute with (`run.cpu_threads`).

Sync mode: the two take turns (generation, then the step). The step runs alone, so the
trainer gets every thread; generation shares the machine with the orchestrator and the
reward-server, which score and build trajectories while it runs, so it leaves them one
(measured on 2 cores with the default run: a rollout-server on both cores made the
generation phase 25% slower). Async mode: they run at once, so the threads are split; the split starts in half and
follows the trainer's measured idle time, one thread at a time: a trainer that waits
for batches more than `GIVE_ABOVE` of its time gives a thread to generation, one that
hardly waits (under `TAKE_BELOW`) takes one back. Each side keeps at least one, and
generation one per rollout-server (`run.local_rollout_servers`), even past the total.

An engine that fixes its threads when it starts (vLLM, SGLang: `rollout_fixed`) keeps
them; the trainer then moves alone, between its starting share and every thread: a
trainer that hardly waits takes one more, sharing the cores with generation, which on
the SmolLM2 example spends most of each step idle at the staleness bound; one that waits
gives it back.
"""

from __future__ import annotations

from dataclasses import dataclass

GIVE_ABOVE = 0.25
"""Trainer idle share above which a thread moves to generation."""
TAKE_BELOW = 0.05
"""Trainer idle share below which a thread comes back to the trainer."""
REPLAN_STEPS = 10
"""Steps between two looks at the trainer's idle time."""


@dataclass
class ThreadPlan:
    total: int
    trainer: int
    rollout: int
    """Threads for generation, shared by the run's rollout-servers."""
    sync: bool
    servers: int = 1
    """Rollout-servers the generation threads are divided among (each keeps one)."""
    fixed: str | None = None
    """Why the plan no longer moves threads (the trainer cannot change its own), or None."""
    rollout_fixed: str | None = None
    """Why generation keeps the threads it started with (its engine cannot change them), or
    None; the trainer's own threads still move."""
    _waited: float = 0.0
    _wall: float = 0.0
    _steps: int = 0

    @classmethod
    def start(cls, total: int, sync: bool, servers: int = 1) -> ThreadPlan:
        """The plan a run starts with: in sync mode every thread to the trainer and all but
        one to generation; half each in async mode (at least one each, and one for each
        of `servers` rollout-servers)."""
        if total < 1:
            raise ValueError(f"a thread plan needs at least one thread, got {total}")
        servers = max(1, servers)
        if sync:
            return cls(total, total, max(servers, total - 1), sync=True, servers=servers)
        trainer = max(1, total // 2)
        return cls(total, trainer, max(servers, total - trainer), sync=False, servers=servers)

    def observe(self, waited: float, wall: float) -> bool:
        """Counts one step (seconds it waited for its batch, seconds in all); every
        `REPLAN_STEPS` steps replans from their idle share. True when the plan changed."""
        self._waited, self._wall, self._steps = (
            self._waited + waited,
            self._wall + wall,
            self._steps + 1,
        )
        if self._steps < REPLAN_STEPS:
            return False
        idle = self._waited / self._wall if self._wall > 0 else 0.0
        self._waited = self._wall = 0.0
        self._steps = 0
        return self.replan(idle)

    def replan(self, trainer_idle: float) -> bool:
        """Moves one thread toward the side that is behind, given the share of the last
        steps the trainer spent waiting for a batch; True when the plan changed. A sync
        plan never changes (each side has every thread while it works), nor a fixed one."""
        if self.sync or self.fixed is not None:
            return False
        if self.rollout_fixed is not None:
            # Generation's threads stay; the trainer borrows them while it is behind.
            if trainer_idle < TAKE_BELOW and self.trainer < self.total:
                self.trainer += 1
                return True
            if trainer_idle > GIVE_ABOVE and self.trainer > max(1, self.total - self.rollout):
                self.trainer -= 1
                return True
            return False
        if trainer_idle > GIVE_ABOVE and self.trainer > 1:
            self.trainer -= 1
            self.rollout += 1
            return True
        if trainer_idle < TAKE_BELOW and self.rollout > self.servers:
            self.trainer += 1
            self.rollout -= 1
            return True
        return False

    def per_server(self, servers: int) -> int:
        """Generation threads of each of `servers` rollout-servers."""
        return max(1, self.rollout // max(1, servers))

    def describe(self) -> str:
        """'trainer T, rollout-server R' (or 'rollout-servers N x R'), as printed at the start."""
        each = self.per_server(self.servers)
        rollout = (
            f"rollout-server {each}"
            if self.servers == 1
            else f"rollout-servers {self.servers} x {each}"
        )
        return f"trainer {self.trainer}, {rollout}"
