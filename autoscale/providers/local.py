"""Simulated engines (`kvmesh sim`) as real processes on this machine, one process per engine.

Each engine binds free ports, announces its URL on stdout, and is stopped (SIGTERM, then SIGKILL) when
terminated or when the owning loop ends. ``offer.provisioning_s`` is waited before the start, so a
simulated fleet feels a cloud's provisioning latency.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProviderError, ProvisionedEngine
from sim.cli import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


@dataclass
class _Child:
    engine: ProvisionedEngine
    process: trio.Process
    stopped: trio.Event


class LocalProvider(Provider):
    name = "local"

    def __init__(self, sim_args: Sequence[str] = (), log_dir: Path | None = None,
                 provisioning_scale: float = 1.0) -> None:
        super().__init__()
        self.sim_args = list(sim_args)
        self.log_dir = log_dir
        self.provisioning_scale = provisioning_scale
        self._children: dict[str, _Child] = {}

    async def _provision(self, request_id: str, offer: Offer) -> ProvisionedEngine:
        await trio.sleep(offer.provisioning_s * self.provisioning_scale)
        argv = [sys.executable, "-m", "sim.cli", "--engines", "1", "--base-port", "0", *self.sim_args]
        log = subprocess.DEVNULL if self.log_dir is None else (self.log_dir / f"{request_id}.log").open("ab")
        try:
            process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=log, cwd=str(REPO_ROOT),
                                                       start_new_session=True)
        except OSError as exc:
            raise ProviderError(f"cannot start a simulated engine: {exc}") from None
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        try:
            with trio.fail_after(START_TIMEOUT_S):
                announced = await _ready_line(process)
        except (trio.TooSlowError, ProviderError) as exc:
            await _stop(process)
            raise ProviderError(f"simulated engine did not start: {exc or 'timeout'}") from None
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

    async def terminate(self, engine_id: str) -> None:
        child = self._children.get(engine_id)
        if child is None:
            raise ProviderError(f"no local engine {engine_id!r}")
        child.stopped.set()
        with trio.move_on_after(STOP_GRACE_S + 2):
            await child.process.wait()

    async def list(self) -> list[ProvisionedEngine]:
        return [c.engine for c in self._children.values() if c.process.returncode is None]


async def _ready_line(process: trio.Process) -> list[dict]:
    assert process.stdout is not None
    buffer = b""
    while True:
        chunk = await process.stdout.receive_some(4096)
        if not chunk:
            raise ProviderError(f"exited with {await process.wait()}")
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith(READY_PREFIX):
                return json.loads(text[len(READY_PREFIX):])


async def _stop(process: trio.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
