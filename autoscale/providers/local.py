"""Simulated engines (`kvmesh sim`) as real processes on this machine, one process per engine.

Engines are forked from a fork server that has the simulator imported already, so a start costs tens of
milliseconds rather than an interpreter start and its imports (seconds on a busy machine): the latency
a provisioning sees is then ``offer.provisioning_s`` (times ``provisioning_scale``), waited before the
start, as a cloud's would be. Each engine binds free ports and reports where it listens through a pipe; it
is stopped (SIGTERM, then SIGKILL) when terminated or when the owning loop ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import trio

from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProviderError, ProvisionedEngine

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


def _fork_context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["autoscale.providers.local", "sim.cli", "sim.fleet"])
    return context


def serve_engine(argv: list[str], report: Connection) -> None:
    """In the child: run one simulated engine with ``kvmesh sim`` flags, send its description, serve until
    SIGTERM.

    The engine leaves the router's session first: with the kernel's autogroup scheduling every session
    shares one CPU slice, so engines in the router's session would take the router's CPU (and each
    other's), as no engine on a machine of its own would."""
    os.setsid()
    from sim.cli import build_parser, config_from_args
    from sim.fleet import describe, run_fleet

    config = config_from_args(build_parser().parse_args(["--engines", "1", "--base-port", "0", *argv]))

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                engines = await nursery.start(run_fleet, config)
                report.send(describe([e.info for e in engines]))
                report.close()
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)


@dataclass
class _Child:
    engine: ProvisionedEngine
    process: BaseProcess
    stopped: trio.Event


class LocalProvider(Provider):
    name = "local"

    def __init__(self, sim_args: Sequence[str] = (), provisioning_scale: float = 1.0) -> None:
        super().__init__()
        self.sim_args = list(sim_args)
        self.provisioning_scale = provisioning_scale
        self._context: Any = None
        self._children: dict[str, _Child] = {}

    async def _provision(self, request_id: str, offer: Offer, term: int) -> ProvisionedEngine:
        await trio.sleep(offer.provisioning_s * self.provisioning_scale)
        if self._context is None:
            self._context = _fork_context()
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(target=serve_engine, args=(self.sim_args, send), daemon=False,
                                        name=f"kvmesh-sim-{request_id}")
        try:
            await trio.to_thread.run_sync(process.start)
            send.close()
            ready = await trio.to_thread.run_sync(receive.poll, START_TIMEOUT_S)
            announced = receive.recv() if ready else None
        except (OSError, EOFError) as exc:
            announced, ready = None, str(exc)
        finally:
            receive.close()
        if not announced:
            await _stop(process)
            raise ProviderError(f"simulated engine did not start ({ready or 'timeout'}, exit {process.exitcode})")
        url = announced[0]["url"]
        engine = ProvisionedEngine(f"local-{url.rsplit(':', 1)[1]}", url, offer.name, offer.island or None)
        child = _Child(engine, process, trio.Event())
        self._children[engine.id] = child
        assert self._nursery is not None
        self._nursery.start_soon(self._keep, child)
        return engine

    async def _keep(self, child: _Child) -> None:
        """Own the process until it is terminated or the loop ends (then it is stopped too)."""
        try:
            await child.stopped.wait()
        finally:
            self._children.pop(child.engine.id, None)
            with trio.CancelScope(shield=True):
                await _stop(child.process)

    async def terminate(self, engine_id: str, term: int) -> None:
        child = self._children.get(engine_id)
        if child is None:
            raise ProviderError(f"no local engine {engine_id!r}")
        child.stopped.set()
        with trio.move_on_after(STOP_GRACE_S + 2):
            while child.process.exitcode is None:
                await trio.sleep(0.05)

    async def list(self, term: int) -> list[ProvisionedEngine]:
        return [c.engine for c in self._children.values() if c.process.exitcode is None]


async def _stop(process: BaseProcess) -> None:
    if process.pid is None:
        return
    if process.exitcode is None:
        process.terminate()
        with trio.move_on_after(STOP_GRACE_S):
            while process.exitcode is None:
                await trio.sleep(0.05)
    if process.exitcode is None:
        process.kill()
    await trio.to_thread.run_sync(process.join, STOP_GRACE_S)
