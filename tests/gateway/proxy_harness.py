"""In-process pieces for upstream and proxy tests: an HTTP server on a loopback port (the simulated
engine's own server) that counts connections, engine states with real pools, and a client-side sink."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway.config import EngineConfig
from gateway.engines import EngineState
from gateway.proxy import Exchange, Timeouts
from gateway.upstream import EnginePool
from sim.config import EngineConfig as SimEngineConfig
from sim.config import FleetConfig
from sim.engine import SimEngine
from sim.fleet import run_fleet
from sim.http_server import Handler, serve_connection


@dataclass
class LoopbackServer:
    port: int = 0
    connections: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_server(nursery: trio.Nursery, handler: Handler, keep_alive_s: float = 5.0,
                       close_race_s: float = 0.0) -> LoopbackServer:
    """``handler`` behind the simulated engine's HTTP server (uvicorn's keep-alive behaviour)."""
    server = LoopbackServer()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server.port = listeners[0].socket.getsockname()[1]

    async def on_connection(stream: trio.SocketStream) -> None:
        server.connections += 1
        await serve_connection(stream, handler, keep_alive_s, close_race_s)

    nursery.start_soon(trio.serve_listeners, on_connection, listeners)
    return server


async def sim_engines(nursery: trio.Nursery, n: int, **engine: Any) -> tuple[list[SimEngine], list[EngineState]]:
    """``n`` fast simulated engines in this process, and the router's state (with its pool) for each."""
    cfg = FleetConfig(engines=n, engine=SimEngineConfig(num_blocks=512, profile="fast", time_scale=0.05, **engine))
    sims = await nursery.start(run_fleet, cfg)
    return sims, [engine_state(s.info.url) for s in sims]


def engine_state(url: str, engine_id: str | None = None) -> EngineState:
    return EngineState(engine_id or url.removeprefix("http://"), EngineConfig(url=url), EnginePool(url))


def failures(engine: EngineState) -> int:
    """Request failures the engine's breaker has recorded (in its window)."""
    return sum(engine.health.breaker._failures)


@dataclass
class Sink:
    """What the proxy sent to the client."""

    messages: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def headers(self) -> dict[str, str]:
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def completion(sink: Sink, body: dict[str, Any], *, stream: bool = False,
               timeouts: Timeouts | None = None, headers: list[tuple[str, str]] | None = None) -> Exchange:
    return Exchange("POST", "/v1/completions", json.dumps(body).encode(),
                    headers or [("content-type", "application/json")], sink.send, timeouts or Timeouts(),
                    lambda engine, attempts: [], stream)
