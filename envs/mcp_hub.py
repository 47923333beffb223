"""The MCP servers of one process: started, connected, timed, restarted.

`McpHub(config)` owns an event loop on a thread of its own, where every MCP
client of the process lives (the `mcp` package is asyncio code; the envs that use
it are blocking envs, called from the env host's thread pool). A server declared
`session: shared` has one connection, started at its first use and started
again after it is lost; `session: episode` servers get a connection of their own
per episode (`McpHub.episode`), in the episode's folder, at most
`max_episode_servers` at once.

Every wait has a limit: starting a server and listing its tools
(`start_timeout_s`), each tool call (`call_timeout_s`). A server that exits, or
does not answer a call in time, is lost: `McpServerLost` is raised, its
connection is closed (its process ended) and counted
(`env_mcp_lost{server,why}`), and the next use starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollwire.services.core.config import McpConfig, McpServerConfig
from rollwire.services.core.metrics import COUNTERS
from rollwire.services.core.sandbox import confine

log = logging.getLogger(__name__)

T = TypeVar("T")
STDERR_TAIL = 800
"""Characters of a server's stderr quoted when it fails to start."""


class McpUnavailable(RuntimeError):
    """An MCP server could not be started or reached, or is not configured."""


class McpServerLost(RuntimeError):
    """An MCP server exited or stopped answering during an episode."""


@dataclass(frozen=True)
class Tool:
    """One tool as the policy sees it: `name` (the server's name with the server's
    `prefix`), what it does and its arguments' JSON schema."""

    name: str
    server: str
    remote: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The tool in the function-calling form chat templates take (`tools=`)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def result_text(result: Any, limit: int) -> tuple[str, bool]:
    """A tool result as text for the policy, and whether the server marked it an error.
    Text parts are joined; an image or audio part is named, not shown; structured
    content stands in when there is no text; past `limit` characters it is cut."""
    pieces = []
    for part in getattr(result, "content", None) or []:
        kind = getattr(part, "type", "")
        if kind == "text":
            pieces.append(part.text)
        elif kind == "resource":
            resource = part.resource
            text = getattr(resource, "text", None)
            pieces.append(text if text is not None else f"[resource {resource.uri}]")
        elif kind == "resource_link":
            pieces.append(f"[resource {part.uri}]")
        else:
            pieces.append(f"[{kind} {getattr(part, 'mime_type', '')}]".replace(" ]", "]"))
    structured = getattr(result, "structured_content", None)
    if not pieces and structured is not None:
        pieces.append(json.dumps(structured, sort_keys=True))
    text = "\n".join(pieces)
    if len(text) > limit:
        text = text[:limit] + f"\n[cut: {len(text) - limit} more characters]"
    return text, bool(getattr(result, "is_error", False))


def _innermost(error: BaseException | None) -> BaseException | None:
    """The first exception inside the task groups' exception groups around it (the one
    that says what went wrong)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _imported(name: str) -> Any:
    """The object `package.module:attribute` names."""
    import importlib

    module, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise McpUnavailable(f"MCP server module {name!r} cannot be loaded: {error}") from None


class Connection:
    """One open MCP client session, held by a task on the hub's loop from start to close."""

    def __init__(
        self, name: str, config: McpServerConfig, workdir: Path, scratch: Path, hub: McpHub
    ) -> None:
        self.name, self.config, self.workdir, self.scratch = name, config, workdir, scratch
        self.hub = hub
        self.client: Any = None
        self.tools: list[Tool] = []
        self.error: BaseException | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._closed = asyncio.Event()
        self._errlog: Any = None
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.client is not None and not self._closed.is_set()

    def _argv(self) -> tuple[list[str], dict[str, str]]:
        config = self.config
        assert config.command is not None
        command = config.command
        if os.sep in command:
            command = str(Path(command).absolute())
        elif (found := shutil.which(command)) is not None:
            command = found
        argv = [command, *(a.replace("{workdir}", str(self.workdir)) for a in config.args)]
        environment = dict(config.env)
        if config.sandbox == "none":
            return argv, environment
        read_only = [*config.read_only]
        # Its install folder: a virtual environment's root, a node_modules tree's owner,
        # and where an interpreter it links to lives.
        read_only += [str(Path(command).parent.parent), str(Path(command).resolve().parent.parent)]
        if Path(command).is_file():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                first = Path(command).read_text(errors="strict")[:200].splitlines()[0]
                if first.startswith("#!"):
                    interpreter = first[2:].split()[0]
                    read_only.append(str(Path(interpreter).resolve().parent.parent))
        return confine(argv, str(self.workdir), read_only, config.network, environment), {}

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        config = self.config
        if config.url is None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            argv, environment = self._argv()
            cwd = (config.cwd or "{workdir}").replace("{workdir}", str(self.workdir))
            environment.setdefault("HOME", str(self.workdir))
            parameters = StdioServerParameters(
                command=argv[0], args=argv[1:], env=environment, cwd=cwd
            )
            async with stdio_client(parameters, errlog=self._errlog) as streams:
                yield streams
            return
        headers = dict(config.headers)
        if config.token_env:
            token = os.environ.get(config.token_env)
            if not token:
                raise McpUnavailable(
                    f"MCP server {self.name!r}: the environment variable {config.token_env} "
                    "(token_env) is not set"
                )
            headers["Authorization"] = f"Bearer {token}"
        if config.transport == "sse":
            from mcp.client.sse import sse_client

            async with sse_client(config.url, headers=headers) as streams:
                yield streams
            return
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(config.url, http_client=http) as streams,
        ):
            yield streams

    async def _hold(self) -> None:
        from mcp import Client

        try:
            target = _imported(self.config.module) if self.config.module else self._transport()
            async with Client(target, cache=None) as client:
                listed = await client.list_tools()
                wanted = self.config.tools
                self.tools = [
                    Tool(
                        self.config.prefix + tool.name,
                        self.name,
                        tool.name,
                        tool.description or "",
                        dict(tool.input_schema or {"type": "object", "properties": {}}),
                    )
                    for tool in listed.tools
                    if wanted is None or tool.name in wanted
                ]
                missing = sorted(set(wanted or ()) - {t.remote for t in self.tools})
                if missing:
                    offered = ", ".join(t.name for t in listed.tools)
                    raise McpUnavailable(
                        f"MCP server {self.name!r} has no tool {', '.join(missing)} "
                        f"(its tools: {offered})"
                    )
                self.client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as error:
            self.error = error
            if not isinstance(error, Exception):
                raise
        finally:
            self._closed.set()
            self._ready.set()

    def _stderr(self) -> str:
        if self._errlog is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._errlog.flush()
            self._errlog.seek(0)
            text = self._errlog.read()
            lines = [line for line in text.splitlines() if line.strip()]
            return "\n".join(lines)[-STDERR_TAIL:]
        return ""

    async def start(self, timeout: float) -> None:
        self._errlog = open(self.scratch / f"{self.name}.stderr", "w+", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._task = asyncio.get_running_loop().create_task(self._hold())
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            tail = self._stderr()  # before close() closes the log
            await self.close()
            raise McpUnavailable(
                f"MCP server {self.name!r} did not start and list its tools within {timeout:g}s"
                + (f"; its stderr: {tail}" if tail else "")
            ) from None
        if self.client is None:
            error, tail = _innermost(self.error), self._stderr()
            await self.close()
            if isinstance(error, McpUnavailable):
                raise error
            what = f"{type(error).__name__}: {error}" if error is not None else "it exited"
            raise McpUnavailable(
                f"MCP server {self.name!r} failed to start: {what}"
                + (f"; its stderr: {tail}" if tail else "")
            )

    async def call(self, remote: str, arguments: dict[str, Any], timeout: float) -> Any:
        """The server's answer to one tool call; McpServerLost when it exits or hangs."""
        from mcp.shared.exceptions import MCPError

        if not self.alive:
            raise McpServerLost(f"MCP server {self.name!r} is not running")
        try:
            return await asyncio.wait_for(self.client.call_tool(remote, arguments), timeout)
        except TimeoutError:
            raise self._lost("hang", f"did not answer {remote!r} within {timeout:g}s") from None
        except MCPError as error:
            if self._closed.is_set() or "closed" in str(error).lower():
                raise self._lost("exit", f"closed the connection: {error}") from None
            return error  # a protocol-level refusal (unknown tool, bad arguments)
        except Exception as error:
            inner = _innermost(error)
            what = f"{type(inner).__name__}: {inner}"
            raise self._lost("exit" if self._closed.is_set() else "error", what) from None

    def _lost(self, why: str, what: str) -> McpServerLost:
        COUNTERS.inc("env_mcp_lost", server=self.name, why=why)
        log.warning("MCP server lost", extra={"server": self.name, "why": why, "detail": what})
        self.hub.forget(self)
        return McpServerLost(f"MCP server {self.name!r} {what}")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10.0)
            except (TimeoutError, Exception):
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._task, 5.0)
        self.client = None
        if self._errlog is not None:
            self._errlog.close()


class EpisodeServers:
    """The MCP servers one episode uses: the shared ones, and its own started in its folder.
    `call` runs a tool by the name the policy knows; `close` ends the episode's own."""

    def __init__(self, hub: McpHub, names: list[str], workdir: Path) -> None:
        self.hub, self.names, self.workdir = hub, names, workdir
        self.connections: dict[str, Connection] = {}
        self._own: list[Connection] = []
        self.tools: dict[str, Tool] = {}

    def open(self) -> None:
        self.hub.run(self._open(), self.hub.config.start_timeout_s * (len(self.names) + 1))

    async def _open(self) -> None:
        for name in self.names:
            config = self.hub.server(name)
            if config.session == "shared":
                connection = await self.hub.shared(name)
            else:
                connection = await self.hub.start_own(name, self.workdir)
                self._own.append(connection)
            self.connections[name] = connection
            for tool in connection.tools:
                if tool.name in self.tools:
                    raise McpUnavailable(
                        f"tool {tool.name!r} is offered by MCP servers {self.tools[tool.name].server!r} "
                        f"and {name!r}; give one of them a `prefix`"
                    )
                self.tools[tool.name] = tool

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        tool = self.tools[name]
        timeout = self.hub.config.call_timeout_s
        connection = self.connections[tool.server]
        return self.hub.run(connection.call(tool.remote, arguments, timeout), timeout + 15.0)

    def close(self) -> None:
        own, self._own = self._own, []
        if own and not self.hub.closed:  # a closed hub has stopped them all
            self.hub.run(self.hub.stop_own(own), 30.0)


class McpHub:
    """The MCP servers of `config` for this process (see the module's docstring)."""

    def __init__(self, config: McpConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()
        self._shared: dict[str, Connection] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._started: set[str] = set()
        self._own_slots = asyncio.Semaphore(config.max_episode_servers)
        self._root = Path(tempfile.mkdtemp(prefix="rollwire-mcp-"))
        self._running_own: set[Connection] = set()
        self.closed = False

    def server(self, name: str) -> McpServerConfig:
        try:
            return self.config.servers[name]
        except KeyError:
            known = ", ".join(sorted(self.config.servers)) or "none"
            raise McpUnavailable(
                f"no MCP server {name!r} is configured on this env-server "
                f"(env_server.mcp.servers); configured: {known}"
            ) from None

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs `coroutine` on the hub's loop and waits for it, at most `timeout` seconds."""
        if self.closed:
            coroutine.close()
            raise McpUnavailable("the MCP hub is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise McpServerLost(f"an MCP operation did not finish within {timeout:g}s") from None

    def episode_folder(self) -> tuple[Path, Path]:
        """A fresh folder for an episode's files (`work`, what its servers see) and beside it
        the servers' logs, which they cannot see."""
        scratch = Path(tempfile.mkdtemp(prefix="episode-", dir=self._root))
        work = scratch / "work"
        work.mkdir()
        return work, scratch

    async def shared(self, name: str) -> Connection:
        connection = self._shared.get(name)
        if connection is not None and connection.alive:
            return connection
        lock = self._starting.setdefault(name, asyncio.Lock())
        async with lock:
            connection = self._shared.get(name)
            if connection is not None and connection.alive:
                return connection
            scratch = Path(tempfile.mkdtemp(prefix=f"shared-{name}-", dir=self._root))
            (scratch / "work").mkdir()
            connection = Connection(name, self.server(name), scratch / "work", scratch, self)
            await connection.start(self.config.start_timeout_s)
            if name in self._started:
                COUNTERS.inc("env_mcp_restarts", server=name)
            self._started.add(name)
            self._shared[name] = connection
            COUNTERS.inc("env_mcp_started", server=name, session="shared")
            return connection

    async def start_own(self, name: str, workdir: Path) -> Connection:
        try:
            await asyncio.wait_for(self._own_slots.acquire(), self.config.start_timeout_s)
        except TimeoutError:
            raise McpUnavailable(
                f"{self.config.max_episode_servers} per-episode MCP servers were running for "
                f"{self.config.start_timeout_s:g}s (env_server.mcp.max_episode_servers)"
            ) from None
        connection = Connection(name, self.server(name), workdir, workdir.parent, self)
        try:
            await connection.start(self.config.start_timeout_s)
        except BaseException:
            self._own_slots.release()
            raise
        COUNTERS.inc("env_mcp_started", server=name, session="episode")
        self._running_own.add(connection)
        return connection

    async def stop_own(self, connections: list[Connection]) -> None:
        for connection in connections:
            if connection not in self._running_own:
                continue
            self._running_own.discard(connection)
            try:
                await connection.close()
            finally:
                self._own_slots.release()

    def forget(self, connection: Connection) -> None:
        """Called on the loop when `connection` is lost: a shared one is dropped (the next
        use starts another) and closed in the background."""
        if self._shared.get(connection.name) is connection:
            del self._shared[connection.name]
        self._loop.create_task(connection.close())

    def close(self) -> None:
        """Stops every server this hub started and its loop."""
        if self.closed:
            return
        shared = list(self._shared.values())

        async def stop() -> None:
            for connection in shared:
                await connection.close()
            await self.stop_own(list(self._running_own))

        with contextlib.suppress(Exception):
            self.run(stop(), 30.0)
        self.closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        shutil.rmtree(self._root, ignore_errors=True)


_HUBS: dict[str, McpHub] = {}
_HUBS_LOCK = threading.Lock()


def hub_for(config: McpConfig) -> McpHub:
    """The process's hub for `config`: one per distinct configuration, made at first use."""
    key = config.model_dump_json()
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None or hub.closed:
            hub = _HUBS[key] = McpHub(config)
        return hub
