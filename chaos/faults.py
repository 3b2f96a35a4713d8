"""Fault actions on a running local cluster, found through the state file ``kvmesh up`` wrote.

Process faults signal the whole process session (a router's tokenizer workers go down and stop with
it, as on a real host). Restarts reuse the recorded command line, ports and environment, and write the
new pid back to the state file so ``kvmesh down`` still finds every process. Engine faults go through
the simulated engine's ``/sim/fault``; partitions through the router's ``/admin/mesh/isolate``. A holder
fault finds its router when it is injected: the one whose ``/admin/autoscaler`` says it acts.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Sequence
from contextlib import suppress
from urllib.parse import urlsplit

import trio

from bench.client import TRANSPORT_ERRORS, HttpClient
from chaos import records as rec
from chaos.monitor import autoscaler_view
from chaos.records import AutoscalerView, FaultAction
from chaos.scenarios import HOLDER_FAULTS, FaultEvent
from cluster import daemon
from cluster.daemon import ProcessRecord
from cluster.state import ClusterState

HEALTH_PATH = {"router": "/ready", "engine": "/health"}
EXIT_GRACE_S = 5.0
HOLDER_TIMEOUT_S = 30.0
"""How long a holder fault waits for exactly one router to act (a lease is claimed within seconds)."""


class FaultError(RuntimeError):
    """A fault could not be applied (the target is missing or did not come back)."""


def engine_id(record: ProcessRecord) -> str:
    """The id routers give an engine configured by URL: its host:port."""
    return urlsplit(record.url or "").netloc if record.role == "engine" else ""


async def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """True when the Redis server at ``url`` answers PING (raw RESP, no client library needed)."""
    parts = urlsplit(url)
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 6379)
            async with stream:
                await stream.send_all(b"PING\r\n")
                return (await stream.receive_some(64)).startswith(b"+PONG")
        except OSError:
            return False
    return False


class FaultInjector:
    """Applies the inject and heal steps of fault events; every step becomes a ``FaultAction``.

    ``clock`` gives seconds since the run started. Processes this injector started are its children
    and are reaped after a kill, so they never linger as zombies. ``headers`` go with every request to a
    router (the admin key on a cluster with auth).
    """

    def __init__(self, state: ClusterState, client: HttpClient, clock: Callable[[], float],
                 restart_timeout: float = 60.0, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.state = state
        self.client = client
        self.clock = clock
        self.restart_timeout = restart_timeout
        self.headers = headers
        self.actions: list[FaultAction] = []
        self._undo: dict[int, Callable[[], object]] = {}
        self._resolved: dict[int, ProcessRecord] = {}

    def target(self, n: int, event: FaultEvent) -> ProcessRecord:
        if event.kind in HOLDER_FAULTS:
            if n not in self._resolved:
                raise FaultError("the lease holder was never found")
            return self._resolved[n]
        candidates = self.state.by_role(event.role)
        if not candidates:
            raise FaultError(f"the cluster has no {event.role}")
        return candidates[event.target % len(candidates)]

    async def lease_holder(self) -> ProcessRecord:
        """The router acting as the autoscaler: asked of every router until exactly one says it acts."""
        routers = self.state.by_role("router")
        with trio.fail_after(HOLDER_TIMEOUT_S):
            while True:
                views = [await self._autoscaler(r) for r in routers]
                acting = [r for r, view in zip(routers, views, strict=True) if view is not None and view.acting]
                if len(acting) == 1:
                    return acting[0]
                await trio.sleep(0.2)

    async def _autoscaler(self, record: ProcessRecord) -> AutoscalerView | None:
        try:
            with trio.fail_after(2.0):
                response = await self.client.request((record.url or "") + "/admin/autoscaler", headers=self.headers)
            return autoscaler_view(json.loads(response.body)) if response.status == 200 else None
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError, RecursionError):
            return None

    async def inject(self, n: int, event: FaultEvent) -> None:
        kind = event.kind
        if kind in HOLDER_FAULTS:
            at = self.clock()
            try:
                self._resolved[n] = await self.lease_holder()
            except trio.TooSlowError:
                self.actions.append(FaultAction(n, kind, rec.ISOLATE, "router", "(lease holder)", at, self.clock(),
                                                False, f"no single router acted within {HOLDER_TIMEOUT_S:g} s"))
                return
        record = self.target(n, event)
        if kind in ("kill-router", "kill-engine", "kill-redis"):
            await self._step(n, event, record, rec.KILL, self._kill(record, signal.SIGKILL))
        elif kind in ("pause-router", "pause-engine"):
            await self._step(n, event, record, rec.PAUSE, self._signal(record, signal.SIGSTOP))
            self._undo[n] = lambda: self._signal_now(record, signal.SIGCONT)
        elif kind == "restart-engine":
            await self._step(n, event, record, rec.STOP, self._kill(record, signal.SIGTERM))
        elif kind in ("partition-router", *HOLDER_FAULTS):
            await self._step(n, event, record, rec.ISOLATE, self._post(record.url, "/admin/mesh/isolate",
                                                                       {"isolated": True}))
        elif kind == "drop-events":
            await self._step(n, event, record, rec.DROP_EVENTS, self._post(record.url, "/sim/fault",
                                                                           {"drop_events": True}))
        else:
            raise FaultError(f"unknown fault kind {kind!r}")

    async def heal(self, n: int, event: FaultEvent) -> None:
        kind = event.kind
        self._undo.pop(n, None)
        if kind in HOLDER_FAULTS and n not in self._resolved:
            return  # never injected: the failed inject is the action on record
        record = self.target(n, event)
        if kind in HOLDER_FAULTS:
            await self._step(n, event, record, rec.KILL, self._kill(record, signal.SIGKILL))
        elif kind in ("kill-router", "kill-engine", "kill-redis", "restart-engine"):
            await self._step(n, event, record, rec.RESTART, self._restart(record))
        elif kind in ("pause-router", "pause-engine"):
            await self._step(n, event, record, rec.RESUME, self._signal(record, signal.SIGCONT))
        elif kind == "partition-router":
            await self._step(n, event, record, rec.REJOIN_MESH, self._post(record.url, "/admin/mesh/isolate",
                                                                           {"isolated": False}))
        elif kind == "drop-events":
            await self._step(n, event, record, rec.RESUME_EVENTS, self._post(record.url, "/sim/fault",
                                                                             {"drop_events": False}))

    def resume_paused(self) -> None:
        """Never leave a process stopped behind: SIGCONT everything this run paused and did not resume."""
        for undo in self._undo.values():
            undo()
        self._undo.clear()

    async def _step(self, n: int, event: FaultEvent, record: ProcessRecord, action: str, work) -> None:
        at = self.clock()
        ok, detail = True, ""
        try:
            await work
        except (FaultError, OSError, *TRANSPORT_ERRORS, trio.TooSlowError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self.actions.append(FaultAction(n, event.kind, action, record.role, record.name, at, self.clock(), ok,
                                        detail, record.pid, engine_id(record)))

    def _signal_now(self, record: ProcessRecord, sig: signal.Signals) -> None:
        members = daemon.session_members(record)
        if not members:
            raise FaultError(f"{record.name} (pid {record.pid}) is not running")
        for pid in members:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def _signal(self, record: ProcessRecord, sig: signal.Signals) -> None:
        self._signal_now(record, sig)

    async def _kill(self, record: ProcessRecord, sig: signal.Signals) -> None:
        """Signal the session and wait (bounded) until it is gone; SIGKILL what outlives the grace."""
        self._signal_now(record, sig)
        with trio.move_on_after(EXIT_GRACE_S):
            while self._running(record):
                await trio.sleep(0.02)
        if self._running(record):
            for pid in daemon.session_members(record):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with trio.fail_after(EXIT_GRACE_S):
                while self._running(record):
                    await trio.sleep(0.02)

    @staticmethod
    def _running(record: ProcessRecord) -> bool:
        with suppress(ChildProcessError, OSError):
            os.waitpid(record.pid, os.WNOHANG)
        return bool(daemon.session_members(record))

    async def _restart(self, record: ProcessRecord) -> None:
        """Start the recorded command again, wait until it answers, then save its new pid."""
        if daemon.alive(record):
            raise FaultError(f"{record.name} is still running (pid {record.pid}); not restarting")
        daemon.spawn(record)
        self.state.save()
        with trio.fail_after(self.restart_timeout):
            while not await self._healthy(record):
                if not daemon.alive(record):
                    raise FaultError(f"{record.name} exited on restart:\n{daemon.log_tail(record, 10)}")
                await trio.sleep(0.05)

    async def _healthy(self, record: ProcessRecord) -> bool:
        if record.role == "redis":
            return await redis_answers(record.url or "")
        try:
            with trio.fail_after(1.0):
                response = await self.client.request((record.url or "") + HEALTH_PATH[record.role])
        except (*TRANSPORT_ERRORS, trio.TooSlowError):
            return False
        return response.status == 200

    async def _post(self, url: str | None, path: str, body: dict) -> None:
        with trio.fail_after(5.0):
            response = await self.client.request((url or "") + path, "POST", json.dumps(body).encode(),
                                                 headers=self.headers)
        if response.status != 200:
            raise FaultError(f"POST {path} answered {response.status}: {response.body[:200]!r}")
