"""A real MCP server built with the official `mcp` SDK (`MCPServer`), for the tool-loop tests.

`python -m tests.servers.mcp_server stdio` serves over stdin/stdout; `... http PORT` serves streamable
HTTP on 127.0.0.1:PORT at /mcp and, when the environment names `MCP_TEST_TOKEN`, answers 401 to a
request without `Authorization: Bearer <token>` (so the config file's `headers` are checked).

Tools: `echo` (its text back), `big` (a result of N megabytes), `die` (the process exits in the
middle of the call, as a crashing server does).
"""

from __future__ import annotations

import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("localrt-test")


@server.tool(description="Say the text back, prefixed with 'echo: '.")
def echo(text: str) -> str:
    return f"echo: {text}"


@server.tool(description="Return a text of `megabytes` MB (the letter x, repeated).")
def big(megabytes: int = 10) -> str:
    return "x" * (megabytes * 1024 * 1024)


@server.tool(description="Exit the server process in the middle of the call.")
def die() -> str:
    sys.stdout.flush()
    os._exit(3)


def http_app(token: str | None):  # type: ignore[no-untyped-def]
    app = server.streamable_http_app()
    if not token:
        return app

    async def guarded(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            sent = dict(scope.get("headers") or []).get(b"authorization", b"").decode()
            if sent != f"Bearer {token}":
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await app(scope, receive, send)

    return guarded


def main() -> None:
    if sys.argv[1] == "stdio":
        server.run("stdio")
        return
    import uvicorn

    port = int(sys.argv[2])
    uvicorn.run(http_app(os.environ.get("MCP_TEST_TOKEN")), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
