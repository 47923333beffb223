"""An MCP server for the tests, written with the `mcp` SDK: stateless tools, a stateful
store, and tools that fail, hang, crash and read host files.

    python tests/helpers/mcp_server.py                 # over stdio
    python tests/helpers/mcp_server.py --http FILE     # Streamable HTTP on a free port,
                                                       # its URL written to FILE when ready
    python tests/helpers/mcp_server.py --sse FILE      # the legacy SSE transport, the same way

Over HTTP, with MCP_TEST_TOKEN set, a request without that bearer token is answered 401.

`server` is the object the in-process tests name (`tests.helpers.mcp_server:server`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer

server = MCPServer("rollwire-test")
_store: dict[str, str] = {}


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def remember(key: str, value: str) -> str:
    """Stores a value under a key in this server process."""
    _store[key] = value
    return "stored"


@server.tool()
def recall(key: str) -> str:
    """The value stored under a key, or 'nothing'."""
    return _store.get(key, "nothing")


@server.tool()
def fail(message: str) -> str:
    """Always fails with the message."""
    raise ValueError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Answers after the given seconds."""
    await asyncio.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Ends this server's process at once."""
    os._exit(3)


@server.tool()
def read(path: str) -> str:
    """The text of a file, or why it cannot be read."""
    try:
        return Path(path).read_text()[:200]
    except OSError as error:
        return f"cannot read: {type(error).__name__}"


def _requiring(app: Any, token: str) -> Any:
    """`app` behind a bearer token: any HTTP request without it is answered 401."""

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != (
            f"Bearer {token}".encode()
        ):
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"a bearer token is required"})
            return
        await app(scope, receive, send)

    return guarded


def _serve_http(ready: Path, transport: str) -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = server.streamable_http_app() if transport == "--http" else server.sse_app()
    path = "/mcp" if transport == "--http" else "/sse"
    if os.environ.get("MCP_TEST_TOKEN"):
        app = _requiring(app, os.environ["MCP_TEST_TOKEN"])
    config = uvicorn.Config(app, log_level="warning")
    instance = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(instance.serve(sockets=[sock]))
        while not instance.started:
            await asyncio.sleep(0.02)
        ready.write_text(f"http://127.0.0.1:{port}{path}")
        await task

    asyncio.run(main())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--http", "--sse"):
        _serve_http(Path(sys.argv[2]), sys.argv[1])
    else:
        server.run()
