"""BlockStore backed by the replicated CRDT document, with a plain PrefixIndex mirror for lookups.

Writes go into the document (one transaction per call); every change of the document's view (local
write, remote update, epoch switch) reaches the mirror exactly once through the document's change
feed, so route lookups never read pycrdt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from index.alias_table import storable
from index.prefix_index import PrefixIndex
from mesh.crdt_doc import SEP, Change, IndexDoc


def _block_key(engine: str, engine_hash: int) -> str:
    return f"{engine}{SEP}{engine_hash}"


def _expiry(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_dispatch(key: str, text: str | None) -> tuple[str, int, float] | None:
    """(engine, own key, expiry) of an ``approx`` entry, or None when malformed or deleted."""
    engine, _, own = key.rpartition(SEP)
    if not engine or text is None:
        return None
    try:
        return engine, int(own), float(text)
    except ValueError:
        return None


def _check_engine(engine: str) -> None:
    if SEP in engine:
        raise ValueError(f"engine id {engine!r} contains the key separator")


class ReplicatedIndex:
    """The store Protocol (index/store.py) over an ``IndexDoc``; replicate ``self.doc`` with mesh/sync."""

    def __init__(self, replica_id: str, mirror: PrefixIndex | None = None) -> None:
        self.doc = IndexDoc(replica_id)
        self.mirror = mirror if mirror is not None else PrefixIndex()
        self.malformed = 0
        self.doc.subscribe(self._on_changes)

    def _on_changes(self, changes: list[Change]) -> None:
        """Apply block changes to the mirror in order, batching runs of the same engine and kind."""
        run_engine, run_store, run = "", True, []
        for name, key, _old, new in changes:
            if name != "blocks":
                continue
            engine, _, hash_text = key.partition(SEP)
            try:
                engine_hash = int(hash_text)
                own = None if new is None else int(new)
                if not storable(engine_hash, own or 0):
                    raise ValueError("block hash out of range")
                item = engine_hash if own is None else (engine_hash, own)
            except ValueError:
                self.malformed += 1
                continue
            if (engine, new is not None) != (run_engine, run_store):
                self._flush(run_engine, run_store, run)
                run_engine, run_store, run = engine, new is not None, []
            run.append(item)
        self._flush(run_engine, run_store, run)

    def _flush(self, engine: str, is_store: bool, run: list) -> None:
        if not run:
            return
        if is_store:
            self.mirror.store(engine, run)
        else:
            self.mirror.remove(engine, run)

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        _check_engine(engine)
        if not all(storable(h, own) for h, own in pairs):
            raise ValueError("block hashes must be folded below 2**63 and own keys fit in 64 bits")
        ops = [("blocks", _block_key(engine, h), str(own)) for h, own in pairs]
        return len(self.doc.write(ops))

    def remove(self, engine: str, engine_hashes: Iterable[int]) -> int:
        _check_engine(engine)
        return len(self.doc.write(("blocks", _block_key(engine, h), None) for h in engine_hashes))

    def clear(self, engine: str) -> int:
        return self.remove(engine, list(self.mirror.pairs(engine)))

    def own_key(self, engine: str, engine_hash: int) -> int | None:
        return self.mirror.own_key(engine, engine_hash)

    def holds(self, engine: str, own_key: int) -> bool:
        return self.mirror.holds(engine, own_key)

    def overlap(self, chain: Sequence[int], engines: Iterable[str] | None = None) -> dict[str, int]:
        return self.mirror.overlap(chain, engines)

    def block_count(self, engine: str) -> int:
        return self.mirror.block_count(engine)

    def engines(self) -> list[str]:
        return self.mirror.engines()

    def pairs(self, engine: str) -> dict[int, int]:
        return self.mirror.pairs(engine)

    def set_seq(self, engine: str, seq: int) -> None:
        """Record the last KV-event seq applied for ``engine`` (so a new owner knows where to resume)."""
        _check_engine(engine)
        self.doc.write([("seq", engine, str(seq))])

    def seq(self, engine: str) -> int | None:
        text = self.doc.content["seq"].get(engine)
        try:
            return None if text is None else int(text)
        except ValueError:
            self.malformed += 1
            return None

    def set_registry(self, engine: str, state: dict[str, Any] | None) -> None:
        """Set (or with None, drop) an engine's admin state: drain, maintenance, island label."""
        _check_engine(engine)
        self.doc.write([("registry", engine, None if state is None else json.dumps(state, sort_keys=True))])

    def registry(self) -> dict[str, dict[str, Any]]:
        return self._decoded(self.doc.content["registry"].items())

    def publish_dispatch(self, engine: str, own_keys: Iterable[int], expires_at: float,
                         refresh_before: float) -> int:
        """Share blocks this replica just sent to ``engine`` (until ``expires_at``, unix seconds).

        Only keys missing from the document, or due to expire before ``refresh_before``, are written, so
        a hot prefix costs one write per half TTL rather than one per request."""
        _check_engine(engine)
        current = self.doc.content["approx"]
        ops = []
        for own_key in own_keys:
            key = f"{engine}{SEP}{own_key}"
            old = current.get(key)
            if old is None or _expiry(old) < refresh_before:
                ops.append(("approx", key, f"{expires_at:.3f}"))
        return len(self.doc.write(ops)) if ops else 0

    def sweep_dispatches(self, now: float) -> int:
        """Delete expired dispatch entries (one replica does this, see MeshNode)."""
        expired = [key for key, text in self.doc.content["approx"].items() if _expiry(text) <= now]
        return len(self.doc.write(("approx", key, None) for key in expired)) if expired else 0

    def set_limits(self, payload: Any) -> None:
        """Publish this replica's rate-limit counts (gateway/admission/ratelimit.py export format)."""
        self.doc.write([("limits", self.doc.replica_id, json.dumps(payload, sort_keys=True))])

    def limits(self) -> dict[str, Any]:
        """Every replica's published rate-limit counts, by replica id."""
        return self._decoded(self.doc.content["limits"].items())

    def _decoded(self, items: Iterable[tuple[str, str]]) -> dict[str, Any]:
        result = {}
        for key, text in items:
            try:
                result[key] = json.loads(text)
            except ValueError:
                self.malformed += 1
        return result
