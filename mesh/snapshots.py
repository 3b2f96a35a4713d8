"""Optional Redis snapshots of the replicated document, so a replica starting into an empty mesh is warm.

One replica at a time (the caller decides which: the node uses the lowest live member id) writes the
whole document (full state, epoch and the epoch's base state vector) to one Redis hash, and only when
the document changed since its last write. A starting replica loads the snapshot once, before it
replicates, through :meth:`mesh.sync_protocol.SyncProtocol.load_snapshot`, whose epoch rules make
this safe: a newer epoch is adopted, the same epoch is merged (CRDT merge of an older state of the same
history is harmless: deletes it lacks are in the peers' delete sets), an older epoch is ignored (the
mesh compacted since). The snapshot is only read at start: read later, a snapshot of an earlier life
of the mesh could resurrect blocks that the current history never saw.

Redis is never required: every error is counted (``kvmesh_mesh_snapshots_total{outcome="error"}``)
and the next round retries. redis-py's asyncio client fails under trio, so the sync client runs in a
worker thread with short socket timeouts.

Redis is not trusted: whoever can write it could otherwise hand every starting replica engine URLs
(prompts flow to them) or numbers that break replication. Each snapshot is sealed with the mesh secret
(HMAC-SHA256, domain ``kvmesh-snapshot-v1``, bound to the cluster's key; every field is sealed, the base
epoch included), its numbers are bounded, one written more than ``MAX_AGE_S`` ago (or in the future) is
stale, and a snapshot that fails to verify, parse or load is ignored with a counted, logged reason
(``kvmesh_mesh_snapshots_rejected_total{reason}``): the replica starts cold. The age bound is what keeps a
genuine but old sealed snapshot (copied aside and written back by whoever can write Redis) from
resurrecting engines and blocks of an earlier life of the mesh.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis
import trio
from prometheus_client import Counter as PromCounter

from mesh.auth import record_mac, record_mac_ok
from mesh.crdt_doc import Change, Epoch, ReplicatedDoc, decode_state, encode_state
from mesh.sync_protocol import SyncProtocol

log = logging.getLogger(__name__)

FORMAT = b"3"
KEY_PREFIX = "kvmesh:snapshot:"
LOAD_TIMEOUT_S = 1.0

SEAL_DOMAIN = b"kvmesh-snapshot-v1"
SEALED_FIELDS = ("format", "epoch_number", "epoch_owner", "base_epoch_number", "base_epoch_owner", "base", "full",
                 "writer", "written_at")
MAX_AGE_S = 3600.0
"""A snapshot older than this is not loaded: a mesh that was down for over an hour starts cold (its engines'
caches are long cold too), and an old snapshot written back into Redis is refused."""
MAX_FUTURE_S = 60.0
"""Clock skew tolerated on ``written_at``."""
MAX_EPOCH = 2**63 - 1
"""Epoch numbers travel in msgpack frames: beyond a signed 64-bit integer every later frame would fail."""

SNAPSHOTS = PromCounter("kvmesh_mesh_snapshots_total", "Redis index snapshots by outcome", ["outcome"])
SNAPSHOTS_REJECTED = PromCounter("kvmesh_mesh_snapshots_rejected_total",
                                 "Redis index snapshots ignored at start, by reason", ["reason"])


class SnapshotRejected(ValueError):
    """A stored snapshot must not be used; ``reason`` is a short label (unsealed, mac, malformed, unusable)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _epoch_number(text: bytes) -> int:
    if not (text.isdigit() and len(text) <= 19 and int(text) <= MAX_EPOCH):
        raise ValueError(f"epoch number {text[:40]!r} is not in 0..2**63-1")
    return int(text)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A whole document as stored in Redis."""

    epoch: Epoch
    base_epoch: Epoch
    base: dict[int, int]
    full: bytes
    writer: str
    written_at: float

    @classmethod
    def of(cls, doc: ReplicatedDoc, written_at: float) -> Snapshot:
        return cls(doc.epoch, doc.base_epoch, dict(doc.base_state), doc.full_update(), doc.replica_id, written_at)

    def to_fields(self) -> dict[str, bytes]:
        return {
            "format": FORMAT,
            "epoch_number": str(self.epoch.number).encode(),
            "epoch_owner": self.epoch.owner.encode(),
            "base_epoch_number": str(self.base_epoch.number).encode(),
            "base_epoch_owner": self.base_epoch.owner.encode(),
            "base": encode_state(self.base),
            "full": self.full,
            "writer": self.writer.encode(),
            "written_at": repr(self.written_at).encode(),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> Snapshot:
        """Decode a stored hash; raises ValueError if it is not a snapshot this code wrote."""
        try:
            if fields[b"format"] != FORMAT:
                raise ValueError(f"unknown snapshot format {fields[b'format']!r}")
            epoch = Epoch(_epoch_number(fields[b"epoch_number"]), fields[b"epoch_owner"].decode())
            base_epoch = Epoch(_epoch_number(fields[b"base_epoch_number"]), fields[b"base_epoch_owner"].decode())
            written_at = float(fields[b"written_at"])
            if not math.isfinite(written_at):
                raise ValueError("written_at is not a finite number")
            return cls(epoch, base_epoch, decode_state(fields[b"base"]), fields[b"full"], fields[b"writer"].decode(),
                       written_at)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"malformed snapshot: {exc!r}") from exc


def seal_fields(secret: bytes, key: str, fields: Mapping[str, bytes]) -> bytes:
    """The MAC of a snapshot hash stored under ``key`` (so a snapshot of one cluster never passes in another)."""
    return record_mac(secret, SEAL_DOMAIN, [key.encode(), *(fields[name] for name in SEALED_FIELDS)])


def open_fields(secret: bytes | None, key: str, stored: Mapping[bytes, bytes], now: float | None = None) -> Snapshot:
    """Verify (when a secret is given), decode and (given ``now``, unix seconds) age-check a stored hash;
    SnapshotRejected says why it is unusable."""
    if secret is not None:
        mac = stored.get(b"mac")
        if mac is None:
            raise SnapshotRejected("unsealed", "the stored snapshot carries no MAC")
        try:
            sealed = {name: stored[name.encode()] for name in SEALED_FIELDS}
        except KeyError as exc:
            raise SnapshotRejected("malformed", f"field {exc} missing") from None
        if not record_mac_ok(secret, SEAL_DOMAIN, [key.encode(), *sealed.values()], mac):
            raise SnapshotRejected("mac", "the MAC does not match this cluster's secret")
    try:
        snapshot = Snapshot.from_fields(stored)
    except ValueError as exc:
        raise SnapshotRejected("malformed", str(exc)) from None
    if now is not None and not now - MAX_AGE_S <= snapshot.written_at <= now + MAX_FUTURE_S:
        raise SnapshotRejected("stale", f"written {now - snapshot.written_at:.0f} s ago")
    return snapshot


class RedisSnapshotStore:
    """Blocking client for the snapshot hash ``kvmesh:snapshot:<cluster>``; use it from a worker thread.

    With ``secret`` (the mesh secret) snapshots are sealed on save and verified on load. Without it they
    are neither, and Redis can rewrite this replica's start: a warning says so.
    """

    def __init__(self, url: str, cluster: str, socket_timeout: float = 0.5, *, secret: bytes | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self.key = KEY_PREFIX + cluster
        self._secret = secret
        self._wall_clock = wall_clock
        if secret is None:
            log.warning("Redis snapshots are not sealed: no mesh secret was given to the snapshot store")

    def save(self, snapshot: Snapshot) -> None:
        """One HSET of every field: readers never see half of a snapshot."""
        fields: dict[str, bytes] = snapshot.to_fields()
        if self._secret is not None:
            fields["mac"] = seal_fields(self._secret, self.key, fields)
        self._client.hset(self.key, mapping=fields)

    def load(self) -> Snapshot | None:
        """The stored snapshot, or None if there is none; SnapshotRejected if it is unsealed, forged or malformed."""
        fields = self._client.hgetall(self.key)
        return open_fields(self._secret, self.key, fields, self._wall_clock()) if fields else None

    def close(self) -> None:
        self._client.close()


def _count(stats: Counter[str], outcome: str) -> None:
    stats[f"snapshot_{outcome}"] += 1
    SNAPSHOTS.labels(outcome).inc()


async def load_into(
    store: RedisSnapshotStore, protocol: SyncProtocol, stats: Counter[str], timeout: float = LOAD_TIMEOUT_S
) -> bool:
    """Load the stored snapshot into ``protocol``'s document (epoch rules apply); False if none was
    loaded. Bounded by ``timeout``: a dead Redis delays a start by at most that much."""
    snapshot = None
    with trio.move_on_after(timeout) as scope:
        try:
            snapshot = await trio.to_thread.run_sync(store.load, abandon_on_cancel=True)
        except SnapshotRejected as exc:
            _reject(stats, exc)
            return False
        except (redis.RedisError, OSError) as exc:
            _count(stats, "error")
            log.warning("cannot load the index snapshot from Redis: %s", exc)
            return False
    if scope.cancelled_caught:
        _count(stats, "error")
        log.warning("loading the index snapshot from Redis took over %.1f s: starting cold", timeout)
        return False
    if snapshot is None:
        _count(stats, "absent")
        return False
    try:
        loaded = protocol.load_snapshot(snapshot.epoch, snapshot.base_epoch, snapshot.base, snapshot.full)
    except Exception as exc:  # what the document or its observers make of stored bytes: never end the start
        _reject(stats, SnapshotRejected("unusable", f"{type(exc).__name__}: {exc}"))
        return False
    _count(stats, "loaded" if loaded else "ignored")
    return loaded


def _reject(stats: Counter[str], exc: SnapshotRejected) -> None:
    _count(stats, "rejected")
    stats[f"snapshot_rejected_{exc.reason}"] += 1
    SNAPSHOTS_REJECTED.labels(exc.reason).inc()
    log.warning("ignoring the index snapshot in Redis (%s): starting cold", exc)


class SnapshotWriter:
    """Saves the document when it changed since the last save; the node runs :meth:`run`."""

    def __init__(
        self,
        store: RedisSnapshotStore,
        doc: ReplicatedDoc,
        is_writer: Callable[[], bool],
        stats: Counter[str],
        wall_clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._doc = doc
        self._is_writer = is_writer
        self._stats = stats
        self._wall_clock = wall_clock
        self._version = 0
        self._saved_version = -1
        doc.subscribe(self._on_changes)

    def _on_changes(self, _changes: list[Change]) -> None:
        self._version += 1

    async def save_if_changed(self) -> bool:
        """Write a snapshot if this replica is the writer and the document changed; errors are counted."""
        if not self._is_writer() or self._version == self._saved_version:
            return False
        version = self._version
        snapshot = Snapshot.of(self._doc, self._wall_clock())
        try:
            await trio.to_thread.run_sync(self._store.save, snapshot, abandon_on_cancel=True)
        except (redis.RedisError, OSError) as exc:
            _count(self._stats, "error")
            log.debug("cannot save the index snapshot to Redis: %s", exc)
            return False
        self._saved_version = version
        _count(self._stats, "saved")
        return True

    async def run(self, interval: float) -> None:
        """Save every ``interval`` seconds until cancelled."""
        while True:
            await trio.sleep(interval)
            await self.save_if_changed()
