"""Measurements for ``kvmesh bench mesh``: one replica's block index ingest, the replicated document's
replication lag. Each returns a plain dict."""

from __future__ import annotations

import os
import statistics
import time

import trio

from index.prefix_index import PrefixIndex
from mesh.crdt_doc import Change, ReplicatedDoc
from mesh.sync import SyncService
from mesh.sync_protocol import SyncProtocol


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ingest_rate(blocks: int = 100_000, batch: int = 32, churn: bool = True) -> dict[str, float]:
    """Block ops/s into one replica's index, in KV-event-sized batches (every replica ingests for itself)."""
    index = PrefixIndex()
    started = time.perf_counter()
    for start in range(0, blocks, batch):
        index.store("engine", [(h, h ^ 0x5A5A) for h in range(start, start + batch)])
    stored = time.perf_counter() - started
    removed_s = 0.0
    if churn:
        started = time.perf_counter()
        for start in range(0, blocks, batch):
            index.remove("engine", range(start, start + batch))
        removed_s = time.perf_counter() - started
    ops = blocks * (2 if churn else 1)
    return {
        "blocks": blocks,
        "batch": batch,
        "store_ops_per_s": blocks / stored,
        "ops_per_s": ops / (stored + removed_s),
    }


async def replication_lag(writes: int = 300, interval: float = 0.01, replicas: int = 3) -> dict[str, float]:
    """Time from a document write on replica 0 until the others see it, over real loopback TCP."""
    secret = os.urandom(32)
    addresses: dict[str, tuple[str, int]] = {}
    docs = [ReplicatedDoc(f"r{i}", ("bench",)) for i in range(replicas)]
    written: dict[int, float] = {}
    lags: list[float] = []

    def observer(changes: list[Change]) -> None:
        now = trio.current_time()
        for name, key, _old, new in changes:
            if name == "bench" and new is not None:
                lags.append(now - written[int(key)])

    for doc in docs[1:]:
        doc.subscribe(observer)
    async with trio.open_nursery() as nursery:
        services = [SyncService(SyncProtocol(doc), secret, lambda: addresses) for doc in docs]
        for doc, service in zip(docs, services, strict=True):
            addresses[doc.replica_id] = ("127.0.0.1", await nursery.start(service.run))
        with trio.fail_after(10):
            while not all(len(service.connected_peers()) == replicas - 1 for service in services):
                await trio.sleep(0.01)
        for n in range(writes):
            written[n] = trio.current_time()
            docs[0].write([("bench", str(n), str(n))])
            await trio.sleep(interval)
        with trio.move_on_after(5):
            while len(lags) < writes * (replicas - 1):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    expected = writes * (replicas - 1)
    return {
        "replicas": replicas,
        "writes": writes,
        "delivered_fraction": len(lags) / expected,
        "lag_p50_ms": 1000 * statistics.median(lags),
        "lag_p99_ms": 1000 * _percentile(lags, 0.99),
        "lag_max_ms": 1000 * max(lags),
    }
