"""Services placed on a Ray cluster (`run.ray`): each one a process a Ray actor runs.

The launcher (`launcher.Stack`) starts, watches, restarts and stops services the same
way whatever runs them; on a Ray cluster a small actor, `ServiceRunner`, is placed by
the service's resources (`run.ray.services`) and runs the very `rollwire SERVICE`
command the local launcher would, with `Popen` on its node, in its own process group,
bound to the node's address. The actor is the service's parent: the service ends when
its actor does (the same parent-death signal a local service has on its launcher), so
a lost node leaves nothing behind, and the launcher, seeing the actor gone, starts the
service again elsewhere within the local launcher's limits (`launcher.MAX_RESTARTS`).

Trainer ranks are gang-placed: a placement group of one bundle per node
(`run.ray.trainer_nodes`) is reserved whole before any rank starts, and each bundle's
actor runs torchrun for that node's ranks, joining rank 0's rendezvous.

What every node must share with the launcher: the run folder and the model cache at
the same paths (the services write their logs, ready files, checkpoints and metrics
there, where `rollwire status` and the launcher read them), and rollwire installed at
the launcher's Python path. Both are checked by each actor before its service starts,
and a node that lacks them stops the run with a message that says which.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollwire.services.app.launcher import LaunchError, LocalSpawner, Service, Spawner
from rollwire.services.core.config.models import RayLauncher, RayPlacement
from rollwire.services.core.server import TRAINER_NODES_ENV

if TYPE_CHECKING:
    from rollwire.services.core.config import RunConfig

LOST = -9
"""The exit code a service gets when its actor or its node is gone (as if SIGKILLed)."""
ASK_SECONDS = 10.0
"""How long one question to an actor may take before its node is looked at."""
BIND = {
    "buffer": ["--host", "{ip}"],
    "reward-server": ["--host", "{ip}"],
    "rollout-server": ["--host", "{ip}"],
    "env-server": ["--host", "{ip}"],
    "trainer": ["--set", "trainer.server.host={ip}"],
}
"""How each command is told to listen on its node's address (the orchestrator serves nothing)."""
PASSED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")
"""The launcher's environment a service on another node gets, beside every ROLLWIRE_*
variable; the rest is the node's own."""
RENDEZVOUS_HERE = "here"
"""In rank 0's node's `ROLLWIRE_TRAINER_NODES`: its actor puts a free address of its node
there, and returns it for the other nodes' actors."""


class ServiceRunner:
    """A Ray actor: runs one service's command on its node and answers for it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: str,
        bind: list[str],
        shared: dict[str, str],
    ) -> dict[str, Any]:
        """Starts `argv` (its Python replaced by this node's) after checking that the
        files in `shared` (path -> expected text, or "" for any) are here."""
        import ray

        ip = ray.util.get_node_ip_address()
        where = f"node {ip} ({os.uname().nodename})"
        for path, expected in shared.items():
            try:
                text = Path(path).read_text() if Path(path).is_file() else ""
                present = Path(path).exists()
            except OSError:
                present, text = False, ""
            if not present or (expected and text.strip() != expected):
                return {
                    "error": f"{where} does not see {path} as the launcher wrote it: a Ray "
                    "run needs run.output_dir and the model cache on storage every node "
                    "mounts at the same path"
                }
        command = [sys.executable, *argv[1:], *(arg.format(ip=ip) for arg in bind)]
        full_env = {**os.environ, **env, "ROLLWIRE_LAUNCHER_PID": str(os.getpid())}
        nodes = env.get(TRAINER_NODES_ENV, "")
        if nodes.endswith("," + RENDEZVOUS_HERE):  # rank 0's node names the rendezvous
            full_env[TRAINER_NODES_ENV] = nodes.removesuffix(RENDEZVOUS_HERE) + free_address(ip)
        with open(log_path, "a") as log:
            try:
                self.process = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    start_new_session=True,
                )
            except OSError as error:
                return {"error": f"{where} could not start {command[0]}: {error}"}
        return {
            "pid": self.process.pid,
            "ip": ip,
            "node_id": ray.get_runtime_context().get_node_id(),
            "rendezvous": full_env.get(TRAINER_NODES_ENV, ",,").split(",")[2],
        }

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal_group(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)


def free_address(ip: str) -> str:
    """`ip:port` of a port free on this node now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        return f"{ip}:{probe.getsockname()[1]}"


class RayProcess:
    """The launcher's handle on a service that `ServiceRunner` actors run: one, or one
    per node for a trainer whose ranks span nodes (the first is rank 0's). It has failed
    when any of them has, and finished when all of them have (rank 1's node may be done
    while rank 0 still writes the final checkpoint)."""

    def __init__(self, actors: list[Any], starts: list[dict[str, Any]], group: Any) -> None:
        self.actors = actors
        self.starts = starts
        self.group = group
        self.pid: int = starts[0]["pid"]
        self.returncode: int | None = None

    @property
    def node_id(self) -> str:
        return self.starts[0]["node_id"]

    @property
    def ip(self) -> str:
        return self.starts[0]["ip"]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        codes = []
        for actor, started in zip(self.actors, self.starts, strict=True):
            try:
                code = ray.get(actor.poll.remote(), timeout=ASK_SECONDS)
            except RayActorError:  # the actor died (its node, or it was killed)
                code = LOST
            except GetTimeoutError:  # a node that stopped answering is gone once Ray says so
                code = None if node_alive(started["node_id"]) else LOST
            if code is not None and code != 0:
                self.returncode = code
                return code
            codes.append(code)
        if all(code == 0 for code in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"service on {self.ip}", timeout)
            time.sleep(0.1)
        return code

    def signal_group(self, sig: int) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for actor in self.actors:
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(actor.signal_group.remote(sig), timeout=ASK_SECONDS)

    def release(self) -> None:
        """Ends the actors (their processes with them) and frees what they reserved."""
        release(self.actors, self.group)
        self.group = None


def release(actors: list[Any], group: Any) -> None:
    """Ends `actors` (their processes with them) and removes the placement group, if any."""
    import ray

    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(group)


REACH_SECONDS = 10.0
"""How long the cluster's GCS port may take to accept a connection: Ray's own client
retries an address nothing listens on for minutes."""


def check_reachable(address: str) -> None:
    """Refuses an address where nothing listens, before a run prepares its model."""
    import socket

    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"run.ray.address {address!r} is not HOST:PORT (or `auto`)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_SECONDS):
            pass
    except OSError as error:
        raise LaunchError(
            f"no Ray cluster answers at run.ray.address {address} ({error}); `ray start "
            "--head` prints the address to give"
        ) from None


def cluster_nodes() -> list[dict[str, Any]]:
    """`ray.nodes()`, or LaunchError when the cluster does not answer within
    3 x ASK_SECONDS: with its head node gone, Ray's own call waits for it for ever."""
    import threading

    import ray

    answer: list[Any] = []

    def ask() -> None:
        try:
            answer.append(ray.nodes())
        except Exception as error:  # whatever Ray raises is told below
            answer.append(error)

    thread = threading.Thread(target=ask, name="ray-nodes", daemon=True)
    thread.start()
    thread.join(3 * ASK_SECONDS)
    if not answer or isinstance(answer[0], Exception):
        why = f": {answer[0]}" if answer else f" within {3 * ASK_SECONDS:g}s"
        raise LaunchError(f"the Ray cluster stopped answering{why} (its head node gone?)")
    return answer[0]


def node_alive(node_id: str) -> bool:
    return any(node["NodeID"] == node_id and node["Alive"] for node in cluster_nodes())


def role_of(service: Service, argv: list[str]) -> str:
    """`run.ray.services`'s name for a service: its command, or `teacher-server`."""
    command = argv[3]
    return "teacher-server" if service.name == "teacher-server" else command


class RaySpawner:
    """Starts the launcher's services on a Ray cluster (`launcher.Spawner`)."""

    def __init__(self, config: RunConfig, run_dir: Path, threads: dict[str, int]) -> None:
        settings = config.run.ray
        assert settings is not None
        try:
            import ray
        except ImportError:
            raise LaunchError(
                "run.ray needs Ray on this machine and every node: pip install 'rollwire[ray]'"
            ) from None
        self.settings: RayLauncher = settings
        self.threads = threads
        self.world_size = config.trainer.world_size
        self.run_dir = run_dir
        # ray.init installs its own SIGTERM and SIGINT handlers (SIGTERM: a stack dump and
        # exit): the launcher's, which stop every service first, are put back.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            ray.init(
                address=settings.address,
                namespace=f"rollwire-{secrets.token_hex(4)}",
                logging_level="ERROR",
                log_to_driver=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise LaunchError(f"run.ray.address {settings.address}: {error}") from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self.runner = ray.remote(ServiceRunner)
        # What every node must see: a token in the run folder (so a folder of the same
        # name on a node's own disk does not pass) and the model the services load.
        token_path = run_dir / "logs" / "ray-shared.token"
        token_path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        token_path.write_text(token + "\n")
        self.shared = {str(token_path): token}
        for model in {config.trainer.model_path, config.rollout_server.model_path} - {None}:
            self.shared[str(model)] = ""
        self.nodes: dict[str, list[str]] = {}

    def spawn(self, service: Service, argv: list[str], fresh: bool) -> RayProcess:
        command = argv[3]
        placement = self.settings.services.get(role_of(service, argv), RayPlacement())
        cpus = placement.num_cpus
        if cpus is None:
            cpus = float(self.threads.get(command, 1))
        asks = {"CPU": cpus, "GPU": placement.num_gpus, **placement.resources}
        if placement.memory is not None:
            asks["memory"] = placement.memory
        env = {
            key: value
            for key, value in service.env.items()
            if key in PASSED_ENV or key.startswith("ROLLWIRE_")
        }
        call = [argv, env, str(service.log_path), BIND.get(command, []), self.shared]
        if command == "trainer" and self.world_size > 1:
            process = self._ranks(service.name, asks, call)
        else:
            previous = service.process if isinstance(service.process, RayProcess) else None
            strategy: Any = "SPREAD" if self.settings.spread else "DEFAULT"
            if not fresh and previous is not None and node_alive(previous.node_id):
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                # Back where it was, so its address stays the one its clients have.
                strategy = NodeAffinitySchedulingStrategy(previous.node_id, soft=True)
            actor, started = self._start(service.name, asks, strategy, call, retry=True)
            process = RayProcess([actor], [started], None)
        labels = sorted(
            {label for started in process.starts for label in self._labels(started["node_id"])}
        )
        nodes = [{"node_id": started["node_id"], "ip": started["ip"]} for started in process.starts]
        (self.run_dir / "logs" / f"{service.name}.node").write_text(
            json.dumps(
                {"node_id": process.node_id, "ip": process.ip, "labels": labels, "nodes": nodes}
            )
            + "\n"
        )
        shown = f" [{', '.join(labels)}]" if labels else ""
        where = ", ".join(f"{node['node_id'][:12]} ({node['ip']})" for node in nodes)
        print(f"{service.name} runs on Ray node{'s' if len(nodes) > 1 else ''} {where}{shown}")
        return process

    def _start(
        self, name: str, asks: dict[str, float], strategy: Any, call: list[Any], retry: bool
    ) -> tuple[Any, dict[str, Any]]:
        """A `ServiceRunner` placed by `strategy` with `asks`, running `call`'s command.
        `retry`: an actor placed on a node that was dying (a lost node is declared dead
        only after its missed heartbeats) is placed again, by the spread strategy alone."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        options = {
            "num_cpus": asks["CPU"],
            "num_gpus": asks["GPU"],
            "resources": {k: v for k, v in asks.items() if k not in ("CPU", "GPU", "memory")},
            "max_restarts": 0,
            "scheduling_strategy": strategy,
        }
        if "memory" in asks:
            options["memory"] = asks["memory"]
        deadline = time.monotonic() + self.settings.place_seconds
        while True:
            actor = self.runner.options(**options).remote()
            try:
                started = ray.get(
                    actor.start.remote(*call), timeout=max(1.0, deadline - time.monotonic())
                )
                break
            except GetTimeoutError:
                ray.kill(actor)
                raise LaunchError(
                    f"Ray had no room for {name} within {self.settings.place_seconds:g}s "
                    f"(run.ray.place_seconds): it asks {describe_resources(asks)}; the cluster "
                    f"has {describe_resources(ray.available_resources())} free"
                ) from None
            except RayActorError as error:
                if not retry or time.monotonic() >= deadline:
                    raise LaunchError(f"{name}'s Ray actor died while starting: {error}") from None
                print(f"{name}: its Ray actor's node died before it started; placing it again")
                options["scheduling_strategy"] = "SPREAD" if self.settings.spread else "DEFAULT"
                time.sleep(1.0)
        if "error" in started:
            ray.kill(actor)
            raise LaunchError(f"{name}: {started['error']}")
        return actor, started

    def _ranks(self, name: str, asks: dict[str, float], call: list[Any]) -> RayProcess:
        """The trainer's ranks, gang-placed: a placement group of one bundle per node
        (`run.ray.trainer_nodes`; each bundle the resources of that node's ranks) is
        reserved whole before any rank starts; the actor of each bundle runs torchrun for
        its node's ranks, rank 0's node first (it names the rendezvous the others join)."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes = self.settings.trainer_nodes
        per_node = self.world_size // nodes
        bundle = {key: value * per_node for key, value in asks.items() if value}
        group = placement_group(
            [dict(bundle) for _ in range(nodes)],
            strategy="STRICT_SPREAD" if nodes > 1 else "STRICT_PACK",
        )
        try:
            ray.get(group.ready(), timeout=self.settings.place_seconds)
        except GetTimeoutError:
            remove_placement_group(group)
            raise LaunchError(
                f"Ray could not place {name}'s {self.world_size} ranks on {nodes} node(s) within "
                f"{self.settings.place_seconds:g}s (run.ray.place_seconds): each node's share "
                f"asks {describe_resources(bundle)}; the cluster has "
                f"{describe_resources(ray.available_resources())} free"
            ) from None
        whole = {"CPU": 0.0, "GPU": 0.0, **bundle}
        actors: list[Any] = []
        starts: list[dict[str, Any]] = []
        try:
            rendezvous = RENDEZVOUS_HERE  # rank 0's node finds it
            for node_rank in range(nodes):
                strategy = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=node_rank
                )
                node_call = list(call)
                if nodes > 1:
                    node_call[1] = {
                        **call[1],
                        TRAINER_NODES_ENV: f"{nodes},{node_rank},{rendezvous}",
                    }
                actor, started = self._start(name, whole, strategy, node_call, retry=False)
                actors.append(actor)
                starts.append(started)
                rendezvous = starts[0]["rendezvous"]
        except LaunchError:
            release(actors, group)
            raise
        return RayProcess(actors, starts, group)

    def _labels(self, node_id: str) -> list[str]:
        """The node's custom resources: how a Ray cluster names its kinds of node."""
        if node_id not in self.nodes:
            self.nodes |= {node["NodeID"]: custom_resources(node) for node in cluster_nodes()}
        return self.nodes.get(node_id, [])

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()


def ray_internal(resource: str) -> bool:
    """A resource Ray adds to every node of itself (its address, its accelerator type)."""
    return resource.startswith(("node:", "accelerator_type"))


def custom_resources(node: dict[str, Any]) -> list[str]:
    standard = ("CPU", "GPU", "memory", "object_store_memory")
    return sorted(
        key for key in node.get("Resources", {}) if key not in standard and not ray_internal(key)
    )


def describe_resources(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items()) if v and not ray_internal(k)}
    return ", ".join(f"{key} {value:g}" for key, value in shown.items()) or "nothing"


def spawner_for(config: RunConfig, run_dir: Path, threads: dict[str, int]) -> Spawner:
    """The run's spawner: local processes, or Ray actors with `run.ray`."""
    if config.run.ray is None:
        return LocalSpawner()
    return RaySpawner(config, run_dir, threads)
