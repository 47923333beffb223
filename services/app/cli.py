"""`rollwire`: one command for every service and for whole runs.

Kept thin: this module imports only the standard library at the top, parses
arguments, then imports what the chosen command needs. `rollwire env-server
--help` therefore answers at once and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollwire.trainer.pipelines.table import PIPELINES, offline

# command -> (config section, module with `registrations(section)`, help)
GRPC_SERVICES: dict[str, tuple[str, str, str]] = {
    "env-server": ("env_server", "rollwire.envs.server", "host environment sessions (EnvService)"),
    "reward-server": (
        "reward_server",
        "rollwire.reward.server",
        "score responses by domain (RewardService)",
    ),
    "rollout-server": (
        "rollout_server",
        "rollwire.rollout.server.servicer",
        "generate tokens with logprobs and take weight updates (RolloutService)",
    ),
}


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE", help="run configuration (YAML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set env_server.max_sessions=100 (repeatable; wins over "
        "the file and ROLLWIRE__SECTION__KEY environment variables)",
    )


def _load(args: argparse.Namespace) -> Any:
    from rollwire.services.core.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as error:
        raise SystemExit(f"rollwire: {error}") from None


def _serve(command: str, args: argparse.Namespace) -> int:
    from rollwire.services.core.config import ConfigError, write_resolved_config

    section_name, module_name, _ = GRPC_SERVICES[command]
    config = _load(args)
    section = getattr(config, section_name)
    try:
        for flag in ("host", "port", "ready_file"):
            if getattr(args, flag) is not None:
                setattr(section.server, flag, getattr(args, flag))
    except ValueError as error:
        raise SystemExit(f"rollwire {command}: {ConfigError(str(error))}") from None
    if args.run_dir is not None:
        config.run.output_dir = args.run_dir
        write_resolved_config(config, args.run_dir)
    from rollwire.services.core.server import run_service

    module = importlib.import_module(module_name)
    if command == "rollout-server":
        from rollwire.services.core.seeds import stream_seed

        # The engine's own generator: rollout_server.seed mixed with run.seed.
        section.seed = stream_seed(config.run.seed, "engine", section.seed)
        watch = config.telemetry.watchdog_seconds
        limits = config.image_inputs.limits()
        return run_service(
            command,
            config,
            section.server,
            lambda: module.registrations(section, watch, limits, config.client),
        )
    if command == "reward-server":  # a judge on a rollout-server is called as a client
        return run_service(
            command, config, section.server, lambda: module.registrations(section, config.client)
        )
    return run_service(command, config, section.server, lambda: module.registrations(section))


def _buffer(args: argparse.Namespace) -> int:
    from rollwire.services.buffer.server import run_buffer
    from rollwire.services.core.config import write_resolved_config

    config = _load(args)
    try:
        if args.host is not None:
            config.buffer.host = args.host
        if args.ready_file is not None:
            config.buffer.ready_file = args.ready_file
    except ValueError as error:
        raise SystemExit(f"rollwire buffer: {error}") from None
    if args.run_dir is not None:
        write_resolved_config(config, args.run_dir)
    return run_buffer(config)


def _process(command: str, runner: str, *extra: Any) -> Callable[[argparse.Namespace], int]:
    """A command whose body is `runner(config, *extra)` ("module:function"), imported
    only when run."""

    def run(args: argparse.Namespace) -> int:

        from rollwire.services.core.config import write_resolved_config

        config = _load(args)
        if args.run_dir is not None:
            write_resolved_config(config, args.run_dir)
        module_name, _, function = runner.partition(":")
        return getattr(importlib.import_module(module_name), function)(config, *extra)

    return run


PROCESSES: dict[str, tuple[str, str]] = {
    "trainer": (
        "rollwire.trainer.process.loop:run_trainer",
        "train on batches from the buffer and publish weights (TrainerService)",
    ),
    "up": (
        "rollwire.services.app.run:run_up",
        "start the servers of a run as local processes, until Ctrl-C",
    ),
    "train": (
        "rollwire.services.app.run:run_train",
        "train end to end, every service a local process (no -c: the built-in default)",
    ),
    "orchestrator": (
        "rollwire.rollout.orchestrator.loop:run_orchestrator",
        "drive episodes and send scored trajectories to the buffer",
    ),
}
"""The services' processes; the pipelines that run alone (`rollwire sft`, `dpo`,
`reward-model`) are commands too, made from the pipeline table
(`rollwire.trainer.pipelines.table.offline`)."""


def _health(args: argparse.Namespace) -> int:
    import asyncio

    import grpc.aio

    from rollwire.services.core.client import (
        check_health,
        describe_error,
        open_channel,
        wait_for_serving,
    )

    config = _load(args)
    if (args.address is None) == (args.ready_file is None):
        raise SystemExit("rollwire health: give an ADDRESS or --ready-file PATH (one of them)")
    if args.ready_file is not None:
        try:
            text = Path(args.ready_file).read_text().strip()
        except OSError:
            text = ""
        if not text:
            print(
                f"{args.ready_file}: no address yet (the service is not serving)", file=sys.stderr
            )
            return 1
        if text.startswith("{"):  # the buffer: ZeroMQ endpoints, no gRPC health service
            return _buffer_health(text, args.timeout)
        args.address = text

    async def probe() -> str:
        async with open_channel(args.address, config.client) as channel:
            if args.wait:
                await wait_for_serving(
                    channel, args.service, timeout=args.timeout, target=args.address
                )
                return "SERVING"
            return await check_health(channel, args.service, timeout=args.timeout)

    try:
        status = asyncio.run(probe())
    except (grpc.aio.AioRpcError, TimeoutError) as error:
        print(f"{args.address}: {describe_error(error)}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _buffer_health(ready: str, timeout: float) -> int:
    """SERVING when both of the buffer's ZeroMQ ports (from its ready file) accept a connection."""
    import json
    import socket

    endpoints = json.loads(ready)
    for name in ("producer", "trainer"):
        host, _, port = endpoints[name].removeprefix("tcp://").rpartition(":")
        host = "127.0.0.1" if host in ("0.0.0.0", "*") else host.strip("[]")
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError as error:
            print(f"buffer {name} endpoint {endpoints[name]}: {error}", file=sys.stderr)
            return 1
    print("SERVING")
    return 0


def _show_config(args: argparse.Namespace) -> int:
    import yaml

    if args.reference:
        from rollwire.services.core.config.reference import markdown

        print(markdown(), end="")
        return 0
    config = _load(args)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


ENV_CHECK_HELP = "run the conformance suite against an env server at ADDRESS"
ENV_CHECK_EPILOG = """\
Checks: health SERVING; ListEnvs; reset determinism by seed; variation across
seeds; the step contract (done flags, Step after the end is FAILED_PRECONDITION,
Step after Close is NOT_FOUND); NOT_FOUND for an unknown env or session;
INVALID_ARGUMENT for an unknown kwarg; an oversized action refused
(RESOURCE_EXHAUSTED or INVALID_ARGUMENT) without losing the session; Close of an
unknown session answers existed=false; --sessions interleaved sessions each
replay what a lone session does; Multiplex (skipped when UNIMPLEMENTED);
still SERVING after all the bad input.

The suite cannot know which actions an env accepts. It steps with candidate
actions -- by default spread-out numbers (50, 25, 75, 1, 0, ...) and common
words (left, right, up, down, yes, no, a, b, pass, ...) -- and treats an
INVALID_ARGUMENT reply as valid behaviour wherever the check is about the
protocol. Give --action (repeatable, replaces the defaults, tried in order) when
your env needs other actions to play and finish an episode.

Results: PASS, FAIL, WARN (allowed but probably unintended, e.g. every seed
gives the same episode), SKIP (could not be judged; the detail says why). Exit
status: 0 when nothing failed, 1 when a check failed, 2 when the server could
not be reached (or the arguments were wrong)."""


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_env_check(commands: Any) -> None:
    check = commands.add_parser(
        "env-check",
        help=ENV_CHECK_HELP,
        description=ENV_CHECK_HELP,
        epilog=ENV_CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("address", help="host:port of the env server to check")
    check.add_argument("--env-id", help="env to exercise (default: the first ListEnvs names)")
    check.add_argument(
        "--env-kwargs",
        metavar="JSON",
        help="constructor arguments for every Reset, e.g. '{\"high\": 10}'",
    )
    check.add_argument(
        "--action",
        dest="actions",
        action="append",
        metavar="TEXT",
        help="a candidate action (repeatable; replaces the built-in candidates)",
    )
    check.add_argument(
        "--timeout",
        type=_positive,
        default=10.0,
        metavar="S",
        help="deadline of every call and of connecting, in seconds (default 10)",
    )
    check.add_argument(
        "--sessions", type=int, default=32, metavar="N", help="sessions played at once (default 32)"
    )
    check.add_argument("--token", help="bearer token to send (else client.auth from the config)")
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_config_options(check)
    check.set_defaults(handler=_env_check)


MISMATCH_HELP = (
    "compare a rollout-server's token logprobs with the trainer's recomputation "
    "(train/inference mismatch)"
)


def _add_mismatch(commands: Any) -> None:
    check = commands.add_parser(
        "mismatch",
        help=MISMATCH_HELP,
        description=MISMATCH_HELP + ": max and mean absolute difference and KL per token.",
    )
    check.add_argument("address", help="host:port of a running rollout-server (any engine)")
    check.add_argument(
        "--model", help="the weights to recompute with (default: the model the server reports)"
    )
    check.add_argument("--requests", type=int, default=32, help="responses to sample (32)")
    check.add_argument("--max-new-tokens", type=int, default=32, help="tokens per response (32)")
    check.add_argument(
        "--temperature", type=_positive, default=1.0, help="sampling temperature (1.0)"
    )
    check.add_argument(
        "--device", default="cpu", help="where the trainer's forward runs (cpu; cuda, cuda:1)"
    )
    check.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the trainer's forward as trainer.precision computes it (fp32)",
    )
    _add_config_options(check)
    check.set_defaults(handler=_mismatch)


def _mismatch(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    # By name, as the services are: the CLI itself stays free of torch (import contract).
    measure = importlib.import_module("rollwire.trainer.rl.mismatch").measure
    config = _load(args)
    try:
        report = asyncio.run(
            measure(
                args.address,
                args.model,
                requests=args.requests,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                client=config.client,
                device=args.device,
                precision=args.precision,
            )
        )
    except (grpc.aio.AioRpcError, OSError) as error:
        print(f"rollwire mismatch: {error}", file=sys.stderr)
        return 2
    print(report.table())
    if report.policy_version != 0 and args.model is None:
        print(
            f"note: the server serves version {report.policy_version}, updated since it loaded "
            "the model it reports; pass --model with those weights for a meaningful comparison"
        )
    return 0


def _usage_error(message: str) -> int:
    print(f"rollwire env-check: {message}", file=sys.stderr)
    return 2


def _env_check(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from rollwire.envs.check import (
        DEFAULT_ACTIONS,
        CheckOptions,
        ServerUnreachable,
        format_table,
        run_checks,
    )
    from rollwire.services.core.config import AuthConfig

    client = _load(args).client
    if args.token is not None:
        client = client.model_copy(update={"auth": AuthConfig(token=args.token)})
    env_kwargs = None
    if args.env_kwargs is not None:
        try:
            env_kwargs = json.loads(args.env_kwargs)
        except json.JSONDecodeError as error:
            return _usage_error(f"--env-kwargs is not JSON: {error}")
        if not isinstance(env_kwargs, dict):
            return _usage_error("--env-kwargs must be a JSON object")
    if args.sessions < 1:
        return _usage_error("--sessions must be at least 1")
    options = CheckOptions(
        env_id=args.env_id,
        env_kwargs=env_kwargs,
        actions=tuple(args.actions) if args.actions else DEFAULT_ACTIONS,
        timeout=args.timeout,
        sessions=args.sessions,
    )
    try:
        report = asyncio.run(run_checks(args.address, options, client))
    except ServerUnreachable as error:
        if args.json:
            print(json.dumps({"address": args.address, "reachable": False, "error": str(error)}))
        print(f"rollwire env-check: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0 if report.passed else 1


def _add_eval(commands: Any) -> None:
    help_text = "held-out reward of a checkpoint (or the run's model) with the run's eval settings"
    sub = commands.add_parser("eval", help=help_text, description=help_text)
    _add_config_options(sub)
    sub.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="a Hugging Face model folder, or a run folder (its newest checkpoint); "
        "default: the model the run starts from",
    )
    sub.add_argument(
        "--samples",
        type=int,
        default=0,
        metavar="K",
        help="also sample K responses per task at rl.temperature: pass@1 and pass@K",
    )
    sub.add_argument(
        "--correct-at",
        type=float,
        default=1.0,
        metavar="R",
        help="a sampled response counts as correct at reward >= R (default 1.0)",
    )

    def run(args: argparse.Namespace) -> int:
        if args.samples < 0:
            raise SystemExit("rollwire eval: --samples cannot be negative")
        # By name, like the other commands: the CLI module itself stays free of torch.
        run_eval = importlib.import_module("rollwire.services.app.run").run_eval
        return run_eval(_load(args), args.checkpoint, args.samples, args.correct_at)

    sub.set_defaults(handler=run)


def _add_distill(commands: Any) -> None:
    help_text = PIPELINES["distill"].help
    sub = commands.add_parser("distill", help=help_text, description=help_text)
    sub.add_argument("action", choices=["generate"], help="what to do (generate: the data)")
    _add_config_options(sub)

    def run(args: argparse.Namespace) -> int:
        # By name, like the other commands: the CLI module itself stays free of torch.
        module = importlib.import_module("rollwire.services.app.run")
        return module.run_distill_generate(_load(args))

    sub.set_defaults(handler=run)


def _add_prepare(commands: Any) -> None:
    help_text = (
        "write the run's model (the configured one, or the built-in tiny one with its "
        "warm-up) into a folder other machines or containers share"
    )
    sub = commands.add_parser("prepare", help=help_text, description=help_text)
    _add_config_options(sub)
    sub.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="the folder to write the model to"
    )

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module("rollwire.services.app.run")
        return module.run_prepare(_load(args), args.out)

    sub.set_defaults(handler=run)


STATUS_HELP = "a live view of a running stack: every service's health, version, queues, rates"
STATUS_EPILOG = """\
WHAT is a run folder (`rollwire train`/`up` wrote its resolved_config.yaml and
logs there) or one or more addresses: host:port for a gRPC service (what it
serves is asked), tcp://host:port for a buffer's producer endpoint. Each refresh
asks every service with a 2-second deadline, so a frozen one shows as not
answering. Exit status (with --once or --json): 0 when every service answered
SERVING, 1 otherwise, 2 when WHAT is neither."""


def _add_status(commands: Any) -> None:
    sub = commands.add_parser(
        "status",
        help=STATUS_HELP,
        description=STATUS_HELP,
        epilog=STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument("what", nargs="+", metavar="WHAT", help="a run folder, or addresses")
    sub.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    sub.add_argument("--once", action="store_true", help="print one table and exit")
    sub.add_argument(
        "--interval", type=_positive, default=2.0, metavar="S", help="seconds between refreshes (2)"
    )
    _add_config_options(sub)

    def run(args: argparse.Namespace) -> int:
        from rollwire.services.app.status import run_status

        return run_status(args.what, _load(args).client, args.json, args.once, args.interval)

    sub.set_defaults(handler=run)


SCALE_HELP = "add or remove rollout-, env- and reward-servers of a running run"
SCALE_EPILOG = """\
CHANGE is ROLE=+N or ROLE=-N, ROLE one of rollout-server, env-server,
reward-server. The run's launcher (`rollwire train` or `up` on RUN_DIR) starts
or stops the servers and updates the run's members file, which the orchestrator
and the trainer read every endpoints.refresh_seconds: a server added takes work
once it serves the current weights; one removed takes no new work and is stopped
when its calls have ended. A role keeps at least one server. Exit status 0 when
all was done, 1 when part of it could not be, 2 for a bad request."""


def _add_scale(commands: Any) -> None:
    sub = commands.add_parser(
        "scale",
        help=SCALE_HELP,
        description=SCALE_HELP,
        epilog=SCALE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run's folder")
    sub.add_argument("changes", nargs="+", metavar="CHANGE", help="ROLE=+N or ROLE=-N")
    sub.add_argument(
        "--timeout", type=_positive, default=330.0, metavar="S", help="seconds to wait (330)"
    )

    def run(args: argparse.Namespace) -> int:
        from rollwire.services.app.scale import request_scale

        return request_scale(args.run_dir, args.changes, args.timeout)

    sub.set_defaults(handler=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollwire",
        description="Asynchronous RL post-training for language models, as independent services.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command, (_, _, help_text) in GRPC_SERVICES.items():
        sub = commands.add_parser(command, help=help_text, description=help_text)
        _add_config_options(sub)
        sub.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
        sub.add_argument("--port", type=int, help="port to bind; 0 picks a free one")
        sub.add_argument(
            "--ready-file", metavar="PATH", help="write the bound host:port here once serving"
        )
        sub.add_argument("--run-dir", metavar="DIR", help="write the resolved config into DIR")
        sub.set_defaults(handler=lambda args, command=command: _serve(command, args))
    buffer = commands.add_parser(
        "buffer",
        help="the replay buffer: trajectories in over ZeroMQ, whole groups out to the trainer",
        description="the replay buffer: trajectories in over ZeroMQ, whole groups out to the trainer",
    )
    _add_config_options(buffer)
    buffer.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
    buffer.add_argument(
        "--ready-file", metavar="PATH", help="write the bound endpoints (JSON) here once serving"
    )
    buffer.add_argument("--run-dir", metavar="DIR", help="write the resolved config into DIR")
    buffer.set_defaults(handler=_buffer)
    for command, (runner, help_text) in PROCESSES.items():
        sub = commands.add_parser(command, help=help_text, description=help_text)
        _add_config_options(sub)
        sub.add_argument("--run-dir", metavar="DIR", help="write the resolved config into DIR")
        sub.set_defaults(handler=_process(command, runner))
    for pipeline in offline():
        sub = commands.add_parser(pipeline.name, help=pipeline.help, description=pipeline.help)
        _add_config_options(sub)
        sub.add_argument("--run-dir", metavar="DIR", help="write the resolved config into DIR")
        run_offline = "rollwire.services.app.run:run_offline"
        sub.set_defaults(handler=_process(pipeline.name, run_offline, pipeline.name))
    _add_eval(commands)
    _add_distill(commands)
    _add_prepare(commands)
    _add_status(commands)
    _add_scale(commands)
    _add_env_check(commands)
    _add_mismatch(commands)
    health = commands.add_parser("health", help="ask a service for its gRPC health status")
    health.add_argument("address", nargs="?", help="host:port of the service")
    health.add_argument(
        "--ready-file",
        metavar="PATH",
        help="read the address from a service's ready file instead (a container's health "
        "check; for the buffer, both of its ZeroMQ ports must accept a connection)",
    )
    health.add_argument(
        "--service", default="", help="service name to ask about ('' = the whole server)"
    )
    health.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)"
    )
    health.add_argument(
        "--wait", action="store_true", help="keep asking until SERVING or the timeout"
    )
    _add_config_options(health)
    health.set_defaults(handler=_health)
    show = commands.add_parser("config", help="print the resolved configuration (validates it)")
    _add_config_options(show)
    show.add_argument(
        "--reference",
        action="store_true",
        help="print every section and key with its type, default and help, as Markdown",
    )
    show.set_defaults(handler=_show_config)
    return parser


LAUNCHER_PID = "ROLLWIRE_LAUNCHER_PID"
"""Set by `rollwire train`/`up` for the services it starts: they end when it does."""


def _end_with_the_launcher() -> None:
    """A service started by `rollwire train` gets SIGTERM when the launcher dies (a trainer
    rank, SIGKILL when its torchrun dies), however it dies (even SIGKILL, when its own
    clean-up never runs), so none is left orphaned.
    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the launcher's own stop() is all."""
    expected = os.environ.get(LAUNCHER_PID)
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    # A trainer rank (torchrun's worker, in a session of its own) whose torchrun is gone
    # cannot finish anything: its group is broken, and a rank waiting in a collective
    # would wait for ever. It ends at once; every other service stops cleanly.
    ends_with = signal.SIGKILL if "TORCHELASTIC_RUN_ID" in os.environ else signal.SIGTERM
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(ends_with))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != expected:  # the launcher died before the line above
        sys.exit("rollwire: the launcher that started this service is gone")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _end_with_the_launcher()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
