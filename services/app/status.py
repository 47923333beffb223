"""`rollwire status RUN_DIR | ADDRESS...`: a live view of a running stack.

For a run folder the services come from its resolved config (the addresses
`rollwire train`/`up` wrote there) and the trainer's log; for addresses, each is
asked what it serves. Every service is shown with its gRPC health, policy
version, queue depths and rates, and the last warning or error in its log; the
run's own progress (step, reward, staleness, throughput, held-out reward) comes
from its metrics files. `--json` prints the same once, for scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from rollwire.proto.v1 import (
    env_pb2,
    env_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from rollwire.services.core.client import check_health, describe_error, open_channel
from rollwire.services.core.config import ClientConfig, ConfigError, load_config
from rollwire.services.core.files import served_address
from rollwire.services.core.members import DNS_PREFIX, Membership

PROBE_SECONDS = 2.0
"""Deadline of every call a refresh makes: a frozen service shows as not answering."""


@dataclass
class ServiceView:
    name: str
    kind: str
    """env-server, reward-server, rollout-server, trainer, buffer, or unknown."""
    address: str
    health: str = "?"
    """SERVING, NOT_SERVING, or what went wrong reaching it."""
    version: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    last_problem: str = ""
    """The newest warning or error line of its log (run folders only)."""


@dataclass
class Target:
    name: str
    kind: str
    address: str
    log: Path | None = None


def targets_of_run(run_dir: Path) -> list[Target]:
    """The services of a run folder written by `rollwire train` or `rollwire up`."""
    resolved = run_dir / "resolved_config.yaml"
    if not resolved.exists():
        raise FileNotFoundError(f"{run_dir} has no resolved_config.yaml: is it a run folder?")
    try:
        config = load_config(resolved, environ={})
    except ConfigError as error:
        raise FileNotFoundError(f"{resolved}: {error}") from None
    logs = run_dir / "logs"
    endpoints = config.endpoints
    found: list[Target] = []

    # Each service the launcher started wrote its address into logs/NAME.ready.
    names = {}
    for ready in logs.glob("*.ready"):
        with contextlib.suppress(OSError):
            names[ready.read_text().strip()] = ready.stem

    def add(kind: str, addresses: list[str], numbered: bool = False) -> None:
        """`numbered`: the launcher names them KIND-0, KIND-1, ... (else KIND, KIND-1, ...)."""
        for index, address in enumerate(addresses):
            name = names.get(address, f"{kind}-{index}" if index or numbered else kind)
            log = logs / f"{name}.log"
            found.append(Target(name, kind, address, log if log.exists() else None))

    def members(role: str, entries: list[str]) -> list[str]:
        """The role's members now: the members file (`rollwire scale` changes it), DNS
        names resolved; the configured list without its names when they do not resolve."""
        try:
            return Membership.of(role, endpoints).members
        except ValueError:
            return [entry for entry in entries if not entry.startswith(DNS_PREFIX)]

    add("reward-server", members("reward-server", endpoints.reward_servers))
    add("rollout-server", members("rollout-server", endpoints.rollout_servers))
    add("rollout-server", endpoints.teacher_servers)
    add("env-server", members("env-server", endpoints.env_servers), numbered=True)
    if endpoints.buffer_producer:
        log = logs / "buffer.log"
        found.append(
            Target("buffer", "buffer", endpoints.buffer_producer, log if log.exists() else None)
        )
    trainer_log = logs / "trainer.log"
    address = endpoints.trainer or served_address(trainer_log)
    if address:
        found.append(
            Target("trainer", "trainer", address, trainer_log if trainer_log.exists() else None)
        )
    return found


def last_problem(log: Path | None) -> str:
    """The newest warning or error of a JSON log, as "HH:MM:SS message"."""
    if log is None or not log.exists():
        return ""
    with log.open("rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - 256_000))
        lines = handle.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        if '"level": "warning"' not in line and '"level": "error"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        when = time.strftime("%H:%M:%S", time.localtime(record.get("ts", 0)))
        message = str(record.get("msg", ""))
        error = record.get("error")
        return f"{when} {record.get('level')}: {message}" + (f" ({error})" if error else "")
    return ""


def _rollout(view: ServiceView, status: Any) -> None:
    view.version = status.policy_version
    view.detail.update(
        engine=status.engine,
        running=status.running_requests,
        waiting=status.waiting_requests,
        generated_tokens=status.generated_tokens,
    )


def _trainer(view: ServiceView, status: Any) -> None:
    view.version = status.policy_version
    view.detail.update(state=status.state, step=status.step, trained=status.trained_trajectories)


KINDS: dict[str, tuple[Callable[[grpc.aio.Channel], Any], Callable[[ServiceView, Any], None]]] = {
    "rollout-server": (
        lambda channel: rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(
            rollout_pb2.RolloutStatusRequest(), timeout=PROBE_SECONDS
        ),
        _rollout,
    ),
    "trainer": (
        lambda channel: trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(
            trainer_pb2.TrainerStatusRequest(), timeout=PROBE_SECONDS
        ),
        _trainer,
    ),
    "env-server": (
        lambda channel: env_pb2_grpc.EnvServiceStub(channel).ListEnvs(
            env_pb2.ListEnvsRequest(), timeout=PROBE_SECONDS
        ),
        lambda view, reply: view.detail.update(envs=len(reply.envs)),
    ),
    "reward-server": (
        lambda channel: reward_pb2_grpc.RewardServiceStub(channel).ListScorers(
            reward_pb2.ListScorersRequest(), timeout=PROBE_SECONDS
        ),
        lambda view, reply: view.detail.update(domains=len(reply.scorers)),
    ),
}
"""Each gRPC service's one cheap call and what its reply shows. An address of unknown
kind is the first whose call is implemented (its reply is then shown, not asked twice)."""


async def _probe_grpc(target: Target, client: ClientConfig) -> ServiceView:
    view = ServiceView(target.name, target.kind, target.address)
    async with open_channel(target.address, client) as channel:
        try:
            view.health = await check_health(channel, "", timeout=PROBE_SECONDS)
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            view.health = f"not answering: {describe_error(error)}"
            return view
        kinds = list(KINDS) if view.kind == "unknown" else [view.kind]
        for kind in kinds:
            call, show = KINDS[kind]
            try:
                reply = await call(channel)
            except grpc.aio.AioRpcError as error:
                if view.kind == "unknown" and error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                view.detail["status"] = describe_error(error)
                reply = None
            if view.kind == "unknown":
                view.kind = kind
                if view.name == view.address:  # an address given alone: name it by what it is
                    view.name = kind
            if reply is not None:
                show(view, reply)
            break
    return view


async def _probe_buffer(target: Target, client: ClientConfig) -> ServiceView:
    from rollwire.services.buffer.client import BufferError, BufferProducer

    view = ServiceView(target.name, "buffer", target.address)
    producer = BufferProducer(target.address, timeout=PROBE_SECONDS, attempts=1, curve=client.curve)
    try:
        status = await producer.status()
    except (BufferError, TimeoutError, OSError) as error:
        view.health = f"not answering: {error}"
        return view
    finally:
        producer.close()
    view.health = "SERVING"
    view.version = status.trainer_version
    view.detail.update(
        ready_groups=status.ready_groups,
        partial_groups=status.partial_groups,
        accepted=status.accepted,
        unacked_batches=status.unacked_batches,
        dropped=sum(status.dropped.values()),
    )
    return view


async def probe(targets: list[Target], client: ClientConfig) -> list[ServiceView]:
    async def one(target: Target) -> ServiceView:
        if target.kind == "buffer" or target.address.startswith("tcp://"):
            view = await _probe_buffer(target, client)
        else:
            view = await _probe_grpc(target, client)
        view.last_problem = last_problem(target.log)
        return view

    return list(await asyncio.gather(*(one(t) for t in targets)))


def progress_of_run(run_dir: Path) -> dict[str, Any]:
    """The run's newest numbers from its metrics files (empty before the first step)."""

    def last(name: str) -> dict[str, Any]:
        path = run_dir / "metrics" / name
        if not path.exists():
            return {}
        for line in reversed(path.read_text(errors="replace").splitlines()):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
        return {}

    trainer, evaluation, orchestrator = (
        last("trainer.jsonl"),
        last("eval.jsonl"),
        last("orchestrator.jsonl"),
    )
    progress: dict[str, Any] = {}
    for key in (
        "step",
        "reward_mean",
        "staleness_mean",
        "trajectories_per_second",
        "trainer_idle_fraction",
    ):
        if key in trainer:
            progress[key] = trainer[key]
    if evaluation:
        progress["eval_reward"] = evaluation.get("eval_reward")
        progress["eval_version"] = evaluation.get("policy_version")
    for key in (
        "groups_completed",
        "groups_failed",
        "tokens_per_second",
        "env_servers_lost",
        "rollout_servers",  # those the orchestrator sends work to now
        "env_servers",
    ):
        if key in orchestrator:
            progress[key] = orchestrator[key]
    return progress


def as_json(views: list[ServiceView], progress: dict[str, Any]) -> str:
    return json.dumps(
        {"time": time.time(), "services": [asdict(v) for v in views], "progress": progress},
        indent=2,
    )


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render(views: list[ServiceView], progress: dict[str, Any], title: str) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, expand=True)
    table.add_column("service", no_wrap=True)
    table.add_column("address", no_wrap=True)
    for column in ("health", "version", "status", "last warning/error"):
        table.add_column(column, overflow="fold")
    for view in views:
        healthy = view.health == "SERVING"
        table.add_row(
            view.name,
            view.address,
            Text(view.health, style="green" if healthy else "bold red"),
            "" if view.version is None else str(view.version),
            ", ".join(f"{k} {_number(v)}" for k, v in view.detail.items()),
            Text(view.last_problem, style="yellow") if view.last_problem else "",
        )
    if not progress:
        return table
    line = "  ".join(f"{k.replace('_', ' ')} {_number(v)}" for k, v in progress.items())
    return Group(table, Text(line))


ADDRESS = re.compile(r"^(tcp://)?[\w.\-\[\]:]+:\d+$")


def run_status(
    what: list[str], client: ClientConfig, as_json_once: bool, once: bool, interval: float
) -> int:
    """`rollwire status`: returns 0 when every service answered SERVING, else 1."""
    run_dir: Path | None = None
    if len(what) == 1 and Path(what[0]).is_dir():
        run_dir = Path(what[0])
        try:
            targets = targets_of_run(run_dir)
        except FileNotFoundError as error:
            print(f"rollwire status: {error}")
            return 2
        title = f"rollwire status: {run_dir}"
    else:
        bad = [item for item in what if not ADDRESS.match(item)]
        if bad:
            print(
                f"rollwire status: {', '.join(bad)}: neither a run folder nor host:port "
                "(tcp://host:port for a buffer)"
            )
            return 2
        targets = [
            Target(item, "buffer" if item.startswith("tcp://") else "unknown", item)
            for item in what
        ]
        title = "rollwire status"

    def snapshot() -> tuple[list[ServiceView], dict[str, Any]]:
        views = asyncio.run(probe(targets, client))
        return views, progress_of_run(run_dir) if run_dir is not None else {}

    def exit_status(views: list[ServiceView]) -> int:
        return 0 if all(v.health == "SERVING" for v in views) else 1

    if as_json_once:
        views, progress = snapshot()
        print(as_json(views, progress))
        return exit_status(views)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    views, progress = snapshot()
    if once:
        console.print(render(views, progress, title))
        return exit_status(views)
    try:
        with Live(render(views, progress, title), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                views, progress = snapshot()
                stamp = f"{title}  (every {interval:g}s, Ctrl-C ends; {time.strftime('%H:%M:%S')})"
                live.update(render(views, progress, stamp), refresh=True)
    except KeyboardInterrupt:
        return 0
