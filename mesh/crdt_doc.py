"""A replicated document of named string maps (sans-IO): local-op log and compaction epochs.

The mesh does not know what the namespaces mean: the caller names them (the router's are listed in
gateway/mesh_state.py). Each namespace is one flat root map of string keys to string values. Flat
root maps (not nested maps) because two replicas creating the same nested map concurrently is a
last-writer-wins conflict that silently drops one side. Values are strings because pycrdt encodes
numbers as float64 (u64 values would lose bits).

What does NOT belong here: anything written at the rate of KV events. One pycrdt item per KV block cost
~60 us of CPU and ~1.3 KB of memory per block on every replica; the block index is not replicated
through this document at all (see gateway/event_ingest.py).

Compaction: tombstones grow without bound under churn, so a replica rebuilds a fresh document from the
live keys under a new ``Epoch``. Peers replace their document when they see a higher epoch; local ops
that the snapshot did not include (judged by the snapshot's base state vector) are written again
onto the new document, so no update is lost across the switch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from pycrdt import Doc, Map, MapEvent, Subscription, TransactionEvent, merge_updates

SEP = "\x1f"

Change = tuple[str, str, str | None, str | None]
"""(map name, key, old value, new value); None means absent."""

Op = tuple[str, str, str | None]
"""(map name, key, new value or None to delete)."""


@dataclass(frozen=True, order=True)
class Epoch:
    """Identity of one document history; the owner breaks ties between concurrent compactions."""

    number: int
    owner: str


GENESIS = Epoch(0, "")


@dataclass(frozen=True)
class _Logged:
    """A local write, located in the history it was made in: ``clock`` of ``client`` in ``epoch``."""

    value: str | None
    epoch: Epoch
    client: int
    clock: int


def encode_state(state: dict[int, int]) -> bytes:
    """Encode a state vector in the lib0 format pycrdt uses (varuint count, then client/clock pairs)."""
    out = bytearray()
    _put_varuint(out, len(state))
    for client, clock in state.items():
        _put_varuint(out, client)
        _put_varuint(out, clock)
    return bytes(out)


def decode_state(data: bytes) -> dict[int, int]:
    """Decode a lib0 state vector; raises ValueError on malformed input."""
    pos = 0

    def take() -> int:
        nonlocal pos
        value, shift = 0, 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ValueError("truncated or oversized varuint in state vector")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    count = take()
    state = {}
    for _ in range(count):
        client = take()
        state[client] = take()
    if pos != len(data):
        raise ValueError("trailing bytes after state vector")
    return state


def _put_varuint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class ReplicatedDoc:
    """One replica's copy of the document plus a plain-dict view of it.

    ``content`` mirrors every map as a dict (reads never touch pycrdt: ``Map.get`` costs 2-3 us).
    Subscribers get each batch of changes exactly once, whether it came from a local write, a remote
    update or an epoch switch.
    """

    def __init__(self, replica_id: str, namespaces: Iterable[str]) -> None:
        if SEP in replica_id:
            raise ValueError("replica id must not contain the key separator")
        self.replica_id = replica_id
        self.namespaces = tuple(namespaces)
        self.epoch = GENESIS
        self.base_epoch = GENESIS
        """The epoch whose state vector ``base_state`` is written in (the history this one was built from)."""
        self.base_state: dict[int, int] = {}
        self.content: dict[str, dict[str, str]] = {name: {} for name in self.namespaces}
        self.churn = 0
        self.malformed_values = 0
        self._log: dict[tuple[str, str], _Logged] = {}
        self._malformed: dict[str, set[str]] = {name: set() for name in self.namespaces}
        """Per namespace, the map's keys whose values are not strings (kept out of ``content``)."""
        self._pending: list[bytes] = []
        self._writing = False
        self._remote_changes: list[Change] = []
        self._subscribers: list[Callable[[list[Change]], None]] = []
        self._attach(Doc())

    def subscribe(self, callback: Callable[[list[Change]], None]) -> None:
        """Call ``callback`` with every batch of changes to ``content``."""
        self._subscribers.append(callback)

    def _attach(self, doc: Doc) -> None:
        self._doc = doc
        self._maps: dict[str, Map] = {name: doc.get(name, type=Map) for name in self.namespaces}
        self._subscriptions = {name: self._observe(name) for name in self.namespaces}
        doc.observe(self._on_transaction)

    def _observe(self, name: str) -> Subscription:
        # partial, not a lambda with a default: pycrdt passes as many arguments as the callable takes.
        return self._maps[name].observe(partial(self._on_map_event, name))

    def _on_transaction(self, event: TransactionEvent) -> None:
        if self._writing:
            self._pending.append(event.update)

    def _on_map_event(self, name: str, event: MapEvent) -> None:
        if self._writing:
            return
        target = self._maps[name]
        self._merge_remote(name, {key: target.get(key) for key in event.keys})
        if len(self.content[name]) + len(self._malformed[name]) != len(target):
            # The event left out a key its transaction changed: yrs names no key, or not every one, for a delete
            # whose item arrived out of order (a dropped frame, then a later store and its clear; a store that
            # overwrote a key adopted from a compaction, then its clear: tests/mesh/test_mesh_crdt_convergence.py).
            # The view is read back from the map.
            live = dict(target.items())
            self._merge_remote(name, {**dict.fromkeys(k for k in self.content[name] if k not in live), **live})

    def _merge_remote(self, name: str, values: dict[str, object]) -> None:
        """Bring the view of ``name`` to the map's ``values`` (None: gone); a value that is not a string is
        counted once and kept out of the view."""
        view, malformed = self.content[name], self._malformed[name]
        for key, value in values.items():
            new = value if isinstance(value, str) else None
            if value is not None and new is None:
                if key not in malformed:
                    malformed.add(key)
                    self.malformed_values += 1
            else:
                malformed.discard(key)
            old = view.get(key)
            if new is None:
                view.pop(key, None)
            else:
                view[key] = new
            if old != new:
                self._remote_changes.append((name, key, old, new))

    def _emit(self, changes: list[Change]) -> None:
        if changes:
            for callback in self._subscribers:
                callback(changes)

    @property
    def client_id(self) -> int:
        return self._doc.client_id

    def live_keys(self) -> int:
        return sum(len(view) for view in self.content.values())

    def write(self, ops: Iterable[Op]) -> list[Change]:
        """Apply local ops in one transaction; ops that change nothing are skipped (no tombstone)."""
        changes: list[Change] = []
        for name, key, value in ops:
            view = self.content[name]
            old = view.get(key)
            if old == value:
                continue
            if value is None:
                del view[key]
            else:
                view[key] = value
            changes.append((name, key, old, value))
        if not changes:
            return changes
        # A flag, not the transaction origin: pycrdt hands doc observers a raw transaction whose
        # origin is not the value given here. The touched maps' observers are detached meanwhile:
        # building a MapEvent for a local write costs more than the write itself.
        touched = {name for name, _key, _old, _value in changes}
        for name in touched:
            self._maps[name].unobserve(self._subscriptions[name])
        self._writing = True
        try:
            with self._doc.transaction():
                for name, key, _old, value in changes:
                    if value is None:
                        del self._maps[name][key]
                    else:
                        self._maps[name][key] = value
        finally:
            self._writing = False
            for name in touched:
                self._subscriptions[name] = self._observe(name)
        client = self.client_id
        clock = decode_state(self._doc.get_state()).get(client, 0)
        for name, key, old, value in changes:
            self.churn += old is not None
            self._log[(name, key)] = _Logged(value, self.epoch, client, clock)
        self._emit(changes)
        return changes

    def apply_update(self, update: bytes) -> list[Change]:
        """Merge a remote update; raises ValueError (and changes nothing) if it cannot be decoded."""
        self._remote_changes = []
        try:
            self._doc.apply_update(update)
        finally:
            changes, self._remote_changes = self._remote_changes, []
        self.churn += sum(old is not None for _n, _k, old, _v in changes)
        self._emit(changes)
        return changes

    def take_update(self) -> bytes | None:
        """The merged local updates since the last call (for the batched broadcast), or None."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        return pending[0] if len(pending) == 1 else merge_updates(*pending)

    def state(self) -> bytes:
        return self._doc.get_state()

    def diff(self, state: bytes) -> bytes:
        """Everything a peer with ``state`` lacks (always includes the delete set, which no state
        vector covers); raises ValueError on a malformed state."""
        decode_state(state)
        return self._doc.get_update(state)

    def full_update(self) -> bytes:
        return self._doc.get_update()

    def encoded_size(self) -> int:
        return len(self._doc.get_update())

    def needs_compaction(self, min_churn: int = 50_000, ratio: float = 1.0) -> bool:
        """True once overwrites and deletes (an estimate of tombstones) outweigh the live keys."""
        return self.churn >= max(min_churn, ratio * self.live_keys())

    def compact(self) -> None:
        """Rebuild the document from live keys under the next epoch owned by this replica."""
        base = decode_state(self._doc.get_state())
        fresh = Doc()
        with fresh.transaction():
            for name in self.namespaces:
                root = fresh.get(name, type=Map)
                for key, value in self.content[name].items():
                    root[key] = value
        epoch = Epoch(self.epoch.number + 1, self.replica_id)
        # Every live value is in the fresh document, written by its one transaction: a snapshot built on
        # this epoch covers them all, so the log is re-stated in its terms (deletes need no record there).
        client = fresh.client_id
        clock = decode_state(fresh.get_state()).get(client, 0)
        self._log = {(name, key): _Logged(entry.value, epoch, client, clock)
                     for (name, key), entry in self._log.items()
                     if entry.value is not None and self.content[name].get(key) == entry.value}
        self._malformed = {name: set() for name in self.namespaces}
        self._switch(epoch, self.epoch, base, fresh)

    def adopt(self, epoch: Epoch, base_epoch: Epoch, base_state: dict[int, int], full: bytes) -> list[Change]:
        """Replace the document with a higher epoch's full state, then re-write local ops it lacks.

        Raises ValueError (changing nothing) if ``full`` cannot be decoded.
        """
        if epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} is not newer than {self.epoch}")
        fresh = Doc()
        fresh.apply_update(full)
        if not epoch.number < 2**63 or not base_epoch.number < 2**63 or base_epoch > epoch:
            raise ValueError(f"epoch {epoch} built on {base_epoch} is out of range")
        incoming: dict[str, dict[str, str]] = {}
        malformed: dict[str, set[str]] = {}
        for name in self.namespaces:
            values = fresh.get(name, type=Map).to_py() or {}
            incoming[name] = {k: v for k, v in values.items() if isinstance(v, str)}
            malformed[name] = {k for k in values if k not in incoming[name]}
            self.malformed_values += len(malformed[name])
        changes: list[Change] = []
        for name in self.namespaces:
            old_view, new_view = self.content[name], incoming[name]
            changes.extend((name, k, v, None) for k, v in old_view.items() if k not in new_view)
            changes.extend((name, k, old_view.get(k), v) for k, v in new_view.items() if old_view.get(k) != v)
        missing = [(name, key, entry.value) for (name, key), entry in self._log.items()
                   if _missing_from(entry, base_epoch, base_state)]
        self.content = incoming
        self._malformed = malformed
        self._switch(epoch, base_epoch, base_state, fresh)
        self._emit(changes)
        # Only the re-written ops stay logged (under the new epoch): every other logged op is in the
        # adopted history, and re-applying it later would overwrite newer writes by others.
        self._log = {}
        self.write(missing)
        return changes

    def _switch(self, epoch: Epoch, base_epoch: Epoch, base_state: dict[int, int], doc: Doc) -> None:
        self.epoch = epoch
        self.base_epoch = base_epoch
        self.base_state = base_state
        self.churn = 0
        self._pending = []
        self._attach(doc)


def _missing_from(entry: _Logged, base_epoch: Epoch, base_state: dict[int, int]) -> bool:
    """Whether a snapshot built on ``base_epoch`` at ``base_state`` lacks a logged local op.

    The log only holds ops of this replica's current epoch (see compact and adopt), so an op of another
    history than the base is missing (the snapshot was built on a branch this replica never joined), and
    an op of the base history is missing when the base state does not cover its clock. Deletes advance no
    clock (they live only in the delete set), so a logged delete is re-applied (write() skips keys that
    are already absent)."""
    if entry.epoch != base_epoch:
        return True
    return entry.value is None or base_state.get(entry.client, 0) < entry.clock
