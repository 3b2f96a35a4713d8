"""One router process: the replica's tasks beside the HTTP server, and a graceful stop.

serve_router
 +- run_replica        (every long-lived task of the replica: gateway/replica.py)
 +- signal watch       (SIGTERM/SIGINT)
 +- asgi_server.serve  (the OpenAI API on Replica.router), stopped gracefully on a signal
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import trio
from prometheus_client import disable_created_metrics

from gateway.asgi_server import ServerSettings, serve
from gateway.config import ConfigError, RouterConfig
from gateway.logs import setup_logging
from gateway.replica import build_replica, run_replica
from gateway.security.posture import log_posture
from gateway.startup_objects import freeze_startup_objects
from gateway.tracing import setup_tracing
from tokenization.registry import encodes_on_the_calling_thread

log = logging.getLogger("kvmesh.server")
CUT_FLUSH_S = 2.0
"""After the grace: how long cut requests get to send their SSE error event or 503 before the process ends."""
READY_PREFIX = "KVMESH_ROUTER_READY "


def server_settings(config: RouterConfig) -> ServerSettings:
    return ServerSettings(config.host, config.port, keep_alive_s=75.0, max_head_bytes=64 * 1024,
                          graceful_s=config.shutdown_grace_s + CUT_FLUSH_S)


async def _wait_for_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return


async def serve_router(config: RouterConfig, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Run until SIGTERM/SIGINT: stop accepting, let in-flight requests finish (bounded), leave the mesh."""
    replica = build_replica(config)
    router = replica.router
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(run_replica, replica)
        nursery.start_soon(_wait_for_signal, stop)
        binds = await nursery.start(serve, router, server_settings(config), stop.wait)
        log.info("router listening", extra={"binds": binds, "policy": config.policy})
        log_posture(config)
        freeze_startup_objects()
        print(READY_PREFIX + json.dumps({"url": binds[0], "pid": os.getpid()}), flush=True)
        task_status.started(router)
        await stop.wait()
        router.shutting_down = True
        with trio.move_on_after(config.shutdown_grace_s):
            while router.active_requests:
                await trio.sleep(0.05)
        if router.active_requests:
            log.warning("shutdown grace over: cutting requests still in flight",
                        extra={"requests": router.cut_requests(), "grace_s": config.shutdown_grace_s})
            with trio.move_on_after(CUT_FLUSH_S):
                while router.active_requests:
                    await trio.sleep(0.05)
        await replica.leave()
        nursery.cancel_scope.cancel()


def main(config: RouterConfig) -> int:
    setup_logging(config.log_level)
    # No reader of /metrics needs a ``_created`` series beside every counter and histogram; without them a
    # page renders a quarter faster, and it renders on the event loop (2-6 ms a scrape at 8 engines).
    disable_created_metrics()
    encodes_on_the_calling_thread()
    try:
        setup_tracing(config.tracing)
        trio.run(serve_router, config)
    except ConfigError as exc:
        print(f"kvmesh router: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0
