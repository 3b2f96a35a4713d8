"""Measurements of the replicated index for ``kvmesh bench mesh``: each returns a plain dict."""

from __future__ import annotations

import os
import statistics
import time

import trio

from index.replicated import ReplicatedIndex
from mesh.crdt_doc import Change
from mesh.sync import SyncService
from mesh.sync_protocol import SyncProtocol


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ingest_rate(blocks: int = 100_000, batch: int = 32, churn: bool = True) -> dict[str, float]:
    """Block ops/s into one replica's document plus mirror, in KV-event-sized batches."""
    index = ReplicatedIndex("bench")
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


def compaction_size(live: int = 100_000, churn_ops: int = 1_000_000, batch: int = 500) -> dict[str, float]:
    """Encoded document size after ``churn_ops`` stores+removes over ``live`` live keys, then compacted."""
    index = ReplicatedIndex("bench")
    protocol = SyncProtocol(index.doc)
    index.store("engine", [(h, h) for h in range(live)])
    next_hash, oldest = live, 0
    for _ in range(churn_ops // (2 * batch)):
        index.store("engine", [(h, h) for h in range(next_hash, next_hash + batch)])
        index.remove("engine", range(oldest, oldest + batch))
        next_hash += batch
        oldest += batch
    before = index.doc.encoded_size()
    started = time.perf_counter()
    protocol.maybe_compact(True, min_churn=0, ratio=0.0)
    compact_s = time.perf_counter() - started
    return {
        "live_keys": index.block_count("engine"),
        "churn_ops": churn_ops,
        "bytes_before": before,
        "bytes_after": index.doc.encoded_size(),
        "compact_s": compact_s,
    }


async def replication_lag(writes: int = 300, interval: float = 0.01, replicas: int = 3) -> dict[str, float]:
    """Time from a write on replica 0 until it shows in the others' mirrors, over real loopback TCP."""
    secret = os.urandom(32)
    addresses: dict[str, tuple[str, int]] = {}
    indexes = [ReplicatedIndex(f"r{i}") for i in range(replicas)]
    written: dict[int, float] = {}
    lags: list[float] = []

    def observer(changes: list[Change]) -> None:
        now = trio.current_time()
        for name, key, _old, new in changes:
            if name == "blocks" and new is not None:
                lags.append(now - written[int(key.rpartition("\x1f")[2])])

    for index in indexes[1:]:
        index.doc.subscribe(observer)
    async with trio.open_nursery() as nursery:
        services = [SyncService(SyncProtocol(index.doc), secret, lambda: addresses) for index in indexes]
        for index, service in zip(indexes, services, strict=True):
            addresses[index.doc.replica_id] = ("127.0.0.1", await nursery.start(service.run))
        with trio.fail_after(10):
            while not all(len(service.connected_peers()) == replicas - 1 for service in services):
                await trio.sleep(0.01)
        for n in range(writes):
            written[n] = trio.current_time()
            indexes[0].store("engine", [(n, n)])
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
