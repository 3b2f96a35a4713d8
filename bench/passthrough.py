"""The floor of kvmesh's stack: a relay built from the router's own server and engine client that does
nothing else. The router's HTTP server takes the request, the router's ``EnginePool`` sends it unchanged to one
engine, and the answer is streamed back chunk by chunk: no parsing, tokenizing, routing, admission or
bookkeeping. In ``kvmesh bench overhead --peers passthrough`` its row shows how much of kvmesh's added
time is the Python HTTP stack itself, which no routing change can remove.

Run as ``python -m bench.passthrough --engine URL --port PORT``; it prints nothing until ready and serves
until killed.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from bench.client import HttpClient
from bench.processes import free_port_range, python_module, spawned, wait_ready
from gateway.asgi_server import serve
from gateway.config import RouterConfig
from gateway.http_app import read_body
from gateway.server import server_settings
from gateway.upstream import EnginePool

RELAYED_HEADERS = frozenset({"content-type", "accept"})


class Passthrough:
    """An ASGI app that forwards every request to one engine."""

    def __init__(self, engine_url: str, max_body_bytes: int) -> None:
        self.pool = EnginePool(engine_url)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        body = await read_body(scope, receive, self.max_body_bytes)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() in RELAYED_HEADERS]
        upstream = await self.pool.request(scope["method"], scope["path"], body, headers)
        try:
            answer_headers = [(k.encode(), v.encode()) for k, v in upstream.headers if k == "content-type"]
            await send({"type": "http.response.start", "status": upstream.status, "headers": answer_headers})
            async for chunk in upstream.iter_body(60.0):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await upstream.aclose()


@asynccontextmanager
async def passthrough_relay(client: HttpClient, engine_url: str, log_dir: Path,
                            pids: dict[str, int] | None = None, cores: frozenset[int] | None = None,
                            root: Path | None = None) -> AsyncIterator[str]:
    """One relay process in front of the engine, on ``cores`` when given, of the code in ``root`` (another
    revision's tree) when given; yields its URL (and notes its pid in ``pids``, by URL)."""
    port = free_port_range(1)
    log = log_dir / f"passthrough-{port}.log"
    argv = python_module("bench.passthrough", "--engine", engine_url, "--port", str(port))
    async with spawned(argv, log, cores=cores, root=root) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(client, url + "/v1/models", proc, log)
        if pids is not None:
            pids[url] = proc.pid
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config = RouterConfig(port=args.port)  # the router's own server settings
    trio.run(serve, Passthrough(args.engine, config.max_body_bytes), server_settings(config), trio.sleep_forever)


if __name__ == "__main__":
    main()
