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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis
import trio
from prometheus_client import Counter as PromCounter

from mesh.crdt_doc import Change, Epoch, ReplicatedDoc, decode_state, encode_state
from mesh.sync_protocol import SyncProtocol

log = logging.getLogger(__name__)

FORMAT = b"2"
KEY_PREFIX = "kvmesh:snapshot:"
LOAD_TIMEOUT_S = 1.0

SNAPSHOTS = PromCounter("kvmesh_mesh_snapshots_total", "Redis index snapshots by outcome", ["outcome"])


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
            epoch = Epoch(int(fields[b"epoch_number"]), fields[b"epoch_owner"].decode())
            base_epoch = Epoch(int(fields[b"base_epoch_number"]), fields[b"base_epoch_owner"].decode())
            return cls(
                epoch,
                base_epoch,
                decode_state(fields[b"base"]),
                fields[b"full"],
                fields[b"writer"].decode(),
                float(fields[b"written_at"]),
            )
        except (KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed snapshot: {exc!r}") from exc


class RedisSnapshotStore:
    """Blocking client for the snapshot hash ``kvmesh:snapshot:<cluster>``; use it from a worker thread."""

    def __init__(self, url: str, cluster: str, socket_timeout: float = 0.5) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self.key = KEY_PREFIX + cluster

    def save(self, snapshot: Snapshot) -> None:
        """One HSET of every field: readers never see half of a snapshot."""
        self._client.hset(self.key, mapping=snapshot.to_fields())

    def load(self) -> Snapshot | None:
        """The stored snapshot, or None if there is none; ValueError if it is malformed."""
        fields = self._client.hgetall(self.key)
        return Snapshot.from_fields(fields) if fields else None

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
        except (redis.RedisError, OSError, ValueError) as exc:
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
    loaded = protocol.load_snapshot(snapshot.epoch, snapshot.base_epoch, snapshot.base, snapshot.full)
    _count(stats, "loaded" if loaded else "ignored")
    return loaded


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
