"""Local processes: prepare the model, start every service on loopback, supervise, stop.

The launcher prepares the model (the built-in tiny one and an optional
supervised warm-up), starts the reward-server, rollout-server and buffer on
ports the OS picks, waits until each is ready, writes their addresses into
the run's resolved config, then starts the trainer and the orchestrator.
It shows progress while training, and stops every process it started — on
success, on failure of any one of them, and on Ctrl-C — by process group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rollwire.services.core.config import RunConfig
from rollwire.services.core.files import building, cache_dir, served_address, staged_directory
from rollwire.services.core.server import EXIT_NO_RESTART

SERVER_COMMANDS = ("reward-server", "rollout-server", "buffer")
RESTARTABLE = (
    "buffer",
    "reward-server",
    "env-server",
    "rollout-server",
    "teacher-server",
    "trainer",
    "orchestrator",
)
"""Services `rollwire train` starts again when they die: none holds what a restart
loses. The buffer rebuilds from its log; a rollout-server holds requests until the
trainer has sent it the current weights (a teacher-server keeps its own); the trainer resumes from its newest
checkpoint and the buffer serves again what it trained after it; the orchestrator
asks the buffer's ledger which prompts to run again. Their clients retry."""
MAX_RESTARTS = 3


class LaunchError(RuntimeError):
    """A service could not be started or died; the message names it and shows its log."""


class LocalProcess:
    """A service's process on this machine, in its own process group."""

    def __init__(self, argv: list[str], env: dict[str, str], log: IO[str]) -> None:
        self.popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.pid = self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        """Its exit code; subprocess.TimeoutExpired if it is still running after `timeout` s."""
        return self.popen.wait(timeout=timeout)

    def signal_group(self, sig: int) -> None:
        """`sig` to its whole process group (workers it spawned too); nothing if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def release(self) -> None:
        """Done with it (the process has ended)."""


class Process(Protocol):
    """What the launcher needs of a service's process: a local one (`LocalProcess`) or
    one a Ray actor runs on a cluster node (`rollwire.services.app.ray_cluster`)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float) -> int: ...

    def signal_group(self, sig: int) -> None: ...

    def release(self) -> None: ...


class Spawner(Protocol):
    """Starts a service's process: `LocalSpawner` here, `RaySpawner` on a Ray cluster."""

    def spawn(self, service: Service, argv: list[str], fresh: bool) -> Process:
        """`fresh` is False for a restart (a Ray spawner places it on the node it had)."""
        ...

    def close(self) -> None: ...


class LocalSpawner:
    def spawn(self, service: Service, argv: list[str], fresh: bool) -> Process:
        return LocalProcess(argv, service.env, service.log_handle)

    def close(self) -> None:
        pass


@dataclass
class Service:
    name: str
    process: Process
    log_path: Path
    ready_file: Path | None
    log_handle: IO[str] = field(repr=False, default=None)
    replica_of: str | None = None
    """Set for one of several replicas (env-servers): the run goes on while one of them lives."""
    reported: bool = False
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    address: str | None = None
    """What it wrote to its ready file; a restart listens on the same port(s)."""
    restarts: int = 0
    retired: bool = False
    """Stopped on purpose (`rollwire scale` took it out): not restarted, not a failure."""

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])


class Stack:
    """The processes of one run; stops them all, by process group, whatever happens."""

    def __init__(
        self,
        run_dir: Path,
        config_path: Path,
        threads: dict[str, int],
        spawner: Spawner | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.config_path = config_path
        self.threads = threads
        self.spawner: Spawner = spawner or LocalSpawner()
        self.services: list[Service] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(
        self,
        command: str,
        ready: bool = True,
        name: str | None = None,
        replica: bool = False,
        extra: tuple[str, ...] = (),
    ) -> Service:
        """Starts `rollwire COMMAND` in its own process group; `name` tells replicas apart;
        `extra` are more arguments (kept for a restart)."""
        name = name or command
        ready_file = self.run_dir / "logs" / f"{name}.ready" if ready else None
        if ready_file is not None and ready_file.exists():
            ready_file.unlink()
        argv = [
            sys.executable,
            "-m",
            "rollwire.services.app.cli",
            command,
            "-c",
            str(self.config_path),
        ]
        if ready_file is not None:
            argv += ["--ready-file", str(ready_file)]
        argv += list(extra)
        threads = str(self.threads.get(command, 1))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            "ROLLWIRE_LAUNCHER_PID": str(os.getpid()),  # services end when this process does
        }
        log_path = self.run_dir / "logs" / f"{name}.log"
        service = Service(
            name,
            None,  # type: ignore[arg-type] - set by _spawn
            log_path,
            ready_file,
            log_path.open("a"),
            replica_of=command if replica else None,
            argv=argv,
            env=env,
        )
        self.services.append(service)
        self._spawn(service, argv, fresh=True)
        return service

    def _spawn(self, service: Service, argv: list[str], fresh: bool) -> None:
        service.process = self.spawner.spawn(service, argv, fresh)
        (self.run_dir / "logs" / f"{service.name}.pid").write_text(f"{service.process.pid}\n")

    def restart(self, service: Service) -> None:
        """Starts a dead service again on the port(s) it had, so its clients find it."""
        argv = list(service.argv)
        if service.address is not None:
            if service.address.startswith("{"):  # the buffer: its two ZeroMQ endpoints
                endpoints = json.loads(service.address)
                for key, endpoint in (("producer_port", "producer"), ("trainer_port", "trainer")):
                    argv += ["--set", f"buffer.{key}={endpoints[endpoint].rsplit(':', 1)[1]}"]
            else:
                argv += ["--port", service.address.rsplit(":", 1)[1]]
        if (service.replica_of or service.name).startswith("rollout-server"):
            argv += self.late_rollout_args()
        if service.ready_file is not None:
            service.ready_file.unlink(missing_ok=True)
        service.restarts += 1
        service.log_handle.write(f"\n--- restarted by the launcher ({service.restarts}) ---\n")
        service.log_handle.flush()
        service.process.release()
        self._spawn(service, argv, fresh=False)

    def late_rollout_args(self) -> list[str]:
        """A rollout-server started mid-run waits for weights, and fetches the newest from
        the trainer's store when the trainer's address is known (its log says it)."""
        args = ["--set", "rollout_server.await_weights=true"]
        trainer = served_address(self.run_dir / "logs" / "trainer.log")
        if trainer is not None:
            args += ["--set", f"rollout_server.weights_from={trainer}"]
        return args

    def wait_ready(self, service: Service, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert service.ready_file is not None
        while time.monotonic() < deadline:
            if service.ready_file.exists() and service.ready_file.read_text().strip():
                service.address = service.ready_file.read_text().strip()
                return service.address
            if service.process.poll() is not None:
                raise LaunchError(
                    f"{service.name} exited with code {service.process.returncode} while starting; "
                    f"its log ({service.log_path}) ends:\n{service.tail()}"
                )
            time.sleep(0.05)
        raise LaunchError(
            f"{service.name} was not ready within {timeout:g}s; its log ({service.log_path}) ends:\n{service.tail()}"
        )

    def check(self, expected_to_finish: tuple[str, ...] = ()) -> None:
        """Restarts a dead service that can be restarted (see RESTARTABLE); raises
        LaunchError if another died (or finished when it should not have)."""
        for service in self.services:
            code = service.process.poll()
            if code is None or service.retired:
                continue
            if service.name in expected_to_finish and code == 0:
                continue
            if code == EXIT_NO_RESTART:
                raise LaunchError(
                    f"{service.name} stopped on an error a restart cannot mend (exit code "
                    f"{code}); its log ({service.log_path}) ends:\n{service.tail()}"
                )
            command = service.replica_of or service.name.rsplit("-", 1)[0]
            if (
                (service.name in RESTARTABLE or command in RESTARTABLE)
                and (service.address is not None or service.ready_file is None)
                and service.restarts < MAX_RESTARTS
            ):
                print(
                    f"\n{service.name} exited with code {code}; restarting it "
                    f"({service.restarts + 1} of {MAX_RESTARTS}; log: {service.log_path})"
                )
                self.restart(service)
                continue
            if service.replica_of is not None and any(
                other is not service
                and service.replica_of in (other.replica_of, other.name)
                and other.process.poll() is None
                and not other.retired
                for other in self.services
            ):
                if not service.reported:
                    service.reported = True
                    print(
                        f"\n{service.name} exited with code {code}; the run goes on with the "
                        f"other {service.replica_of}s (log: {service.log_path})"
                    )
                continue
            raise LaunchError(
                f"{service.name} exited with code {code}; its log ({service.log_path}) ends:\n{service.tail()}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM in reverse start order, then SIGKILL whatever is left of each process group."""
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for service in reversed(self.services):
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # SIGKILL the whole group: it also ends worker processes the service spawned.
            service.process.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(timeout=10)
            service.process.release()
            service.log_handle.close()
        self.spawner.close()


WARM_UP_STEP = "SupervisedStep"
"""Part of a warm-up's cache key: a cached model of another implementation is not reused."""


def prepare_model(config: RunConfig, progress: bool = True) -> Path:
    """The model every service starts from: the configured one, or the tiny one (warmed up if asked).

    The trainer and the rollout-servers must start from the same weights, so
    `rollout_server.model_path` and `trainer.model_path` name one model: set either
    (or both, the same)."""
    named = {
        key: Path(value)
        for key, value in (
            ("rollout_server.model_path", config.rollout_server.model_path),
            ("trainer.model_path", config.trainer.model_path),
        )
        if value is not None
    }
    if len({path.resolve() for path in named.values()}) > 1:
        raise LaunchError(
            "rollout_server.model_path and trainer.model_path name different models "
            f"({', '.join(f'{k}={v}' for k, v in named.items())}); the trainer and the "
            "rollout-servers must start from the same weights: set one of them"
        )
    if named:
        key, path = next(iter(named.items()))
        if not (path / "config.json").exists():
            raise LaunchError(f"{key} {path} is not a Hugging Face model folder (no config.json)")
        if config.warmup.steps and progress:
            print(f"warm-up skipped: it trains the built-in tiny model, and {key} is set")
        return path
    if config.rollout_server.engine == "diffusion":
        # The built-in diffusion model: trained once into the cache, as the warm-up is.
        from rollwire.diffusion.digits import digits_model

        return digits_model(threads=warm_up_threads(), progress=progress)
    from rollwire.services.core.tiny import TinySpec, tiny_model_of

    spec = TinySpec(**config.run.tiny_model)
    check_context(config, spec.max_position_embeddings)
    base = tiny_model_of(config.run.tiny_model)
    warmup = config.warmup
    if warmup.steps == 0:
        return base
    dataset = config.orchestrator.dataset
    if dataset.type == "env":
        return _warm_up_agent(config, base, spec, progress)
    from rollwire.services.core.datasets import training_tasks
    from rollwire.trainer.pipelines.warmup import warm_up

    dataset = _warm_up_dataset(dataset, warmup.seed, warmup.dataset_size)
    held_out = config.orchestrator.eval_dataset
    key = _digest(
        {
            "spec": spec.__dict__,
            "warmup": warmup.model_dump(mode="json"),
            "step": WARM_UP_STEP,
            "dataset": dataset.model_dump(mode="json"),
            "held_out": held_out.model_dump(mode="json") if held_out is not None else None,
            "template": config.orchestrator.prompt_template,
        }
    )
    target = cache_dir() / f"warm-{key}"
    if (target / "config.json").exists():
        return target
    # The warm-up is training too: it never sees a prompt of the evaluation set.
    tasks = training_tasks(dataset, held_out)
    if progress and tasks.excluded:
        print(f"warm-up: {tasks.excluded} prompts of the evaluation set left out")
    return _built_once(
        target,
        lambda staging: warm_up(
            base,
            staging,
            tasks,
            config.orchestrator.prompt_template,
            warmup.response_template,
            warmup.steps,
            batch_size=warmup.batch_size,
            learning_rate=warmup.learning_rate,
            seed=warmup.seed,
            threads=warm_up_threads(),
            progress=progress,
            off_by_one_rate=warmup.off_by_one_rate,
        ),
    )


def _warm_up_dataset(dataset: Any, seed: int, size: int) -> Any:
    """The training dataset with the warm-up's own seed and size where it has them (a file
    dataset is what it is); a mixture keeps its parts and weights."""
    if dataset.type == "mixture":
        parts = [
            part.model_copy(update={"dataset": _warm_up_dataset(part.dataset, seed, size)})
            for part in dataset.parts
        ]
        return dataset.model_copy(update={"parts": parts})
    if dataset.type == "reasoning_gym":
        return dataset.model_copy(update={"seed": seed, "size": size})
    return dataset


def _warm_up_agent(config: RunConfig, base: Path, spec: Any, progress: bool) -> Path:
    """Warm-up on episodes a scripted demonstrator plays in the run's environment."""
    from transformers import AutoTokenizer

    from rollwire.envs.demos import demo_batches, find_demonstrator
    from rollwire.envs.registry import load_plugins, provided
    from rollwire.rollout.orchestrator.agent import ChatTurns, PlainTurns
    from rollwire.services.core.vision import VisionSide, is_vision_model
    from rollwire.trainer.pipelines.warmup import warm_up_on

    warmup, dataset, orchestrator = config.warmup, config.orchestrator.dataset, config.orchestrator
    agent = orchestrator.agent
    key = _digest(
        {
            "spec": spec.__dict__,
            "warmup": warmup.model_dump(mode="json"),
            "step": WARM_UP_STEP,
            "env": [dataset.env_id, dataset.env_kwargs],
            "agent": agent.model_dump(mode="json"),
            "chat": orchestrator.use_chat_template,
            # An mcp env's tool results come from the operator's servers.
            "mcp": config.env_server.mcp.model_dump(mode="json"),
        }
    )
    target = cache_dir() / f"warm-{key}"
    if (target / "config.json").exists():
        return target
    load_plugins(config.env_server.plugins)  # the demonstrations play the env in this process
    try:
        find_demonstrator(dataset.env_id)
    except ValueError as error:
        # An env served from elsewhere (any language) or one without a scripted player: the
        # run goes on from the untrained model rather than stopping before it starts.
        if progress:
            print(f"warm-up skipped: {error}")
        return base
    tokenizer = AutoTokenizer.from_pretrained(base)
    vision = VisionSide(base, config.image_inputs.limits()) if is_vision_model(base) else None

    def make_turns() -> ChatTurns | PlainTurns:
        if orchestrator.use_chat_template:
            return ChatTurns(tokenizer, agent.system_prompt, vision, agent.tool_prompt)
        return PlainTurns(tokenizer, agent.observation_template, vision, agent.tool_prompt)

    # Warm-up seeds lie past the training and evaluation ones.
    first = warmup.seed * 1_000_000_007 % (1 << 40) + (1 << 41)
    batches = demo_batches(
        dataset.env_id,
        dataset.env_kwargs,
        range(first, first + warmup.dataset_size),
        tokenizer,
        make_turns,
        warmup.demo_kwargs,
        agent.max_turns,
        agent.max_episode_tokens,
        given := provided(dataset.env_id, config.env_server),
    )
    try:
        return _built_once(
            target,
            lambda staging: warm_up_on(
                base,
                staging,
                batches,
                warmup.steps,
                batch_size=warmup.batch_size,
                learning_rate=warmup.learning_rate,
                seed=warmup.seed,
                threads=warm_up_threads(),
                progress=progress,
            ),
        )
    finally:
        if "mcp" in given:  # the MCP servers the demonstrations used
            given["mcp"].close()


def _built_once(target: Path, build: Callable[[Path], Any]) -> Path:
    """The cache entry `target`, written whole by `build(staging folder)` unless it is
    there; two runs that want it at once build it once (the second waits for the first)."""
    with building(target, "config.json") as ready:
        if not ready:
            with staged_directory(target, keep_if_present="config.json") as staging:
                build(staging)
    return target


def warm_up_threads() -> int:
    """The warm-up computes alone, before the services start: on every core, or on
    OMP_NUM_THREADS of them when that is set (a machine shared with other work)."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, os.cpu_count() or 1)


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def check_context(config: RunConfig, context: int) -> None:
    """An episode cap or answer length past the built-in model's context fails every group
    it reaches; refused before anything starts, naming both numbers."""
    orchestrator = config.orchestrator
    where = "the built-in tiny model's context (run.tiny_model.max_position_embeddings)"
    if orchestrator.dataset.type == "env" and orchestrator.agent.max_episode_tokens > context:
        raise LaunchError(
            f"orchestrator.agent.max_episode_tokens is {orchestrator.agent.max_episode_tokens} but "
            f"{where} is {context} tokens: lower the cap to at most {context}, or raise the context"
        )
    if orchestrator.max_new_tokens >= context:
        raise LaunchError(
            f"orchestrator.max_new_tokens is {orchestrator.max_new_tokens} but {where} is "
            f"{context} tokens, which must also hold the prompt: lower it or raise the context"
        )


def start_servers(
    config: RunConfig, stack: Stack, timeout: float = 120.0, services: Sequence[str] = ()
) -> RunConfig:
    """Starts the servers among `services` (by default those of the run's pipeline,
    `rollwire.trainer.pipelines.table.pipeline_of`): the reward-server, the
    rollout-server(s) (`run.local_rollout_servers`), the buffer, a teacher rollout-server
    on distill.teacher_model_path (unless endpoints.teacher_servers names some); and for
    an `env` dataset the env-servers (unless the config names some). Returns the config
    with their endpoints. Evaluations and distillation data ask for `SAMPLING_SERVICES`:
    they sample and score (`rollwire.rollout.orchestrator.sampler`), and nothing trains."""
    from rollwire.trainer.pipelines.table import pipeline_of

    services = tuple(services) or pipeline_of(config).services
    # Rollout-servers of the start serve the initial weights until the trainer sends
    # others: a trainer to fetch from (a compose run's resolved config read again, as
    # `rollwire eval` does) is not this run's.
    fresh = {"rollout-server": ("--set", "rollout_server.weights_from=null")}
    started = {
        name: stack.start(name, extra=fresh.get(name, ()))
        for name in SERVER_COMMANDS
        if name in services
    }
    rollout_count = config.run.local_rollout_servers
    extra_rollout = [
        stack.start("rollout-server", name=f"rollout-server-{i}", extra=fresh["rollout-server"])
        for i in range(1, rollout_count)
    ]
    env_servers = []
    if config.orchestrator.dataset.type == "env" and not config.endpoints.env_servers:
        count = config.run.local_env_servers or 1
        env_servers = [
            stack.start("env-server", name=f"env-server-{i}", replica=count > 1)
            for i in range(count)
        ]
    if "teacher-server" in services and not config.endpoints.teacher_servers:
        distill = config.distill
        started["teacher-server"] = stack.start(
            "rollout-server",
            name="teacher-server",
            extra=(
                "--set",
                f"rollout_server.model_path={distill.teacher_model_path}",
                "--set",
                f"rollout_server.engine={distill.teacher_engine}",
                "--set",
                "rollout_server.await_weights=false",
                *fresh["rollout-server"],
            ),
        )
    addresses = {name: stack.wait_ready(service, timeout) for name, service in started.items()}
    update: dict[str, Any] = {
        # The servers just started are the run's; a members file of another run (a resolved
        # config read again, as `rollwire eval` does) names servers that are not.
        "members_file": None,
        "reward_servers": [addresses["reward-server"]] if "reward-server" in addresses else [],
        "rollout_servers": [
            addresses["rollout-server"],
            *(stack.wait_ready(server, timeout) for server in extra_rollout),
        ],
    }
    if "buffer" in addresses:
        sockets = json.loads(addresses["buffer"])
        update |= {"buffer_producer": sockets["producer"], "buffer_trainer": sockets["trainer"]}
    if "teacher-server" in addresses:
        update["teacher_servers"] = [addresses["teacher-server"]]
    if env_servers:
        update["env_servers"] = [stack.wait_ready(s, timeout) for s in env_servers]
    endpoints = config.endpoints.model_copy(update=update)
    run = config.run.model_copy(update={"local_env_servers": None})  # now in endpoints
    return config.model_copy(update={"endpoints": endpoints, "run": run})


def thread_budget(config: RunConfig) -> dict[str, int]:
    """Threads per process, from the config (each defaults to 1 so two cores are not oversubscribed)."""
    return {
        "rollout-server": config.rollout_server.threads,
        "trainer": config.trainer.threads,
        "reward-server": 1,
        "env-server": 1,
        "buffer": 1,
        "orchestrator": 1,
    }
