"""Samples the cluster every ~0.5 s: process RSS and fds, router index fingerprints, engine counters and,
when the routers run an autoscaler, each router's ``/admin/autoscaler`` (acting, term) and the standby
pool's provisions.

Each probe has its own short timeout, so a paused process costs one round a second, never a hang.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from bench.client import TRANSPORT_ERRORS, HttpClient
from bench.engine_stats import HITS, QUERIES, parse_counters
from chaos.records import AutoscalerView, PoolView, ProcessSample, Sample
from cluster import daemon
from cluster.daemon import ProcessRecord
from cluster.state import ClusterState

PROBE_TIMEOUT_S = 1.0


def process_sample(record: ProcessRecord) -> ProcessSample:
    """RSS (VmRSS, kB) and open fd count from /proc; ``alive`` False for a dead or zombie process."""
    if not daemon.alive(record):
        return ProcessSample(record.pid, False)
    try:
        status = Path(f"/proc/{record.pid}/status").read_text()
        fds = sum(1 for _ in Path(f"/proc/{record.pid}/fd").iterdir())
    except OSError:
        return ProcessSample(record.pid, False)
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    # A process being torn down after SIGKILL has no memory map left: it is no longer alive.
    return ProcessSample(record.pid, False) if rss is None else ProcessSample(record.pid, True, rss, fds)


def index_fingerprint(payload: object) -> dict[str, str] | None:
    """Per engine, the content digest from ``/admin/index`` (the block count when no digest is given)."""
    engines = payload.get("engines") if isinstance(payload, dict) else None
    if not isinstance(engines, dict):
        return None
    out = {}
    for engine, row in engines.items():
        if not isinstance(row, dict):
            return None
        out[str(engine)] = str(row.get("digest", row.get("blocks")))
    return out


def autoscaler_view(payload: object) -> AutoscalerView | None:
    """``acting``, ``term`` and ``me`` from a router's ``/admin/autoscaler``; None when malformed."""
    if not isinstance(payload, dict):
        return None
    acting, term, me = payload.get("acting"), payload.get("term"), payload.get("me")
    if not isinstance(acting, bool) or not isinstance(term, int) or isinstance(term, bool) or not isinstance(me, str):
        return None
    return AutoscalerView(acting, term, me)


def read_pool(path: Path) -> PoolView | None:
    """The standby pool's provisions and request ids, read under the shared lock its writers respect (None
    before the first call or when malformed)."""
    try:
        with path.open() as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            data = json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    provisions, requests = data.get("provisions", 0), data.get("requests", [])
    if not isinstance(provisions, int) or not isinstance(requests, list):
        return None
    return PoolView(provisions, tuple(str(r) for r in requests))


class Monitor:
    """Collects ``Sample`` rounds into ``samples`` until cancelled. ``headers`` go with every router probe
    (the admin key on a cluster with auth)."""

    def __init__(self, state: ClusterState, client: HttpClient, clock: Callable[[], float],
                 interval: float = 0.5, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.state = state
        self.client = client
        self.clock = clock
        self.interval = interval
        self.headers = headers
        self.samples: list[Sample] = []

    async def run(self) -> None:
        while True:
            started = trio.current_time()
            self.samples.append(await self.sample())
            await trio.sleep_until(started + self.interval)

    async def sample(self) -> Sample:
        sample = Sample(self.clock())
        for record in self.state.processes:
            if record.role in ("router", "engine"):
                sample.processes[record.name] = process_sample(record)
        async with trio.open_nursery() as nursery:
            for record in self.state.by_role("router"):
                nursery.start_soon(self._index, sample, record)
                if self.state.pool_file:
                    nursery.start_soon(self._autoscaler, sample, record)
            for record in self.state.by_role("engine"):
                nursery.start_soon(self._counters, sample, record)
        if self.state.pool_file:
            sample.pool = read_pool(Path(self.state.pool_file))
        return sample

    async def _get(self, url: str) -> bytes | None:
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                response = await self.client.request(url, headers=self.headers)
        except (*TRANSPORT_ERRORS, trio.TooSlowError):
            return None
        return response.body if response.status == 200 else None

    async def _index(self, sample: Sample, record: ProcessRecord) -> None:
        raw = await self._get((record.url or "") + "/admin/index")
        try:
            sample.indexes[record.name] = index_fingerprint(json.loads(raw)) if raw is not None else None
        except ValueError:
            sample.indexes[record.name] = None

    async def _autoscaler(self, sample: Sample, record: ProcessRecord) -> None:
        raw = await self._get((record.url or "") + "/admin/autoscaler")
        try:
            sample.autoscaler[record.name] = autoscaler_view(json.loads(raw)) if raw is not None else None
        except (ValueError, RecursionError):
            sample.autoscaler[record.name] = None

    async def _counters(self, sample: Sample, record: ProcessRecord) -> None:
        raw = await self._get((record.url or "") + "/metrics")
        try:
            sample.counters[record.name] = (
                parse_counters(raw.decode("utf-8", errors="replace"), (HITS, QUERIES)) if raw is not None else None
            )
        except ValueError:
            sample.counters[record.name] = None
