"""What a router replicates through the mesh's document, and how it reads it back (the router's adapter).

Namespaces (flat maps of string keys to string values, see mesh/crdt_doc.py):

- ``registry``: ``"<engine>"`` -> JSON engine config and admin state (url, events, drain, island, ...), or
                ``{"removed": true, "removed_at"}`` (deleted by the leader an hour later)
- ``approx``:   ``"<engine>\\x1f<replica>\\x1f<bucket>"`` -> ``"<expiry>:<base64 of u64 own keys>"``: the
                blocks that replica sent to that engine, packed per expiry bucket (approximate entries of
                engines without events, speculative entries of the others); see ``DispatchBuckets``
- ``limits``:   ``"<replica>"`` -> JSON of that replica's windowed request/token counts per tenant
- ``homes``:    ``"<replica>\\x1f<slot>"`` -> ``"<sequence>:<JSON list of [prefix home key, engine, blocks, engine
                blocks, conversation digest, blocks the engine held]>"``: the requests that replica placed since
                its previous write (``PlacementOutbox``), which every other replica records in its own home book
                as if it had placed them; write n goes to slot n mod ``PLACEMENT_SLOTS``, so writes closer together
                than the mesh's broadcasts still reach the peers each (a peer sees only a key's latest value)
- ``autoscaler``: ``"lease"`` -> JSON lease (holder, expiry, term) and ``"members"`` -> JSON list of the
                replica ids quorum is counted against (autoscale/lease.py); ``"state"``,
                ``"pending:<request>"`` and ``"engine:<id>"`` -> JSON written by the lease holder

The block index itself is not here: every replica ingests every engine's KV events itself and a starting
replica takes a peer's index by state transfer (gateway/index_transfer.py). Each key has one writer at a
time (an admin action, the replica named in the key, or the replica that dispatched), so concurrent
writes to one key are rare.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mesh.crdt_doc import SEP, Change
from mesh.node import MeshNode

log = logging.getLogger("kvmesh.mesh")

NAMESPACES = ("registry", "approx", "limits", "autoscaler", "homes")
MAX_JSON_BYTES = 64 * 1024
"""A registry or limits value larger than this is refused (a replica writes a few hundred bytes)."""

RegistryCallback = Callable[[str, dict[str, Any] | None], None]
DispatchCallback = Callable[[str, list[int], float], None]
BUCKETS_PER_TTL = 4
"""Dispatched blocks are grouped by expiry into buckets a quarter of the TTL wide: a block stays shared at
most a quarter TTL longer than asked, and a (engine, replica) pair has at most five buckets live."""
MAX_BUCKET_KEYS = 1024
"""Blocks one bucket holds (11 KB of document); further blocks of that bucket are not shared. With one
document key per block, ~280k dispatched blocks took the document past the 16 MiB frame limit; packed and
capped, the document holds at most ~60 KB per (engine, replica) whatever the traffic."""
LimitsCallback = Callable[[str, Any], None]
Placement = tuple[str, str, int, int | None, str, int]
"""A request placed by a replica: its home key, engine, prompt blocks, the engine's capacity, the conversation it
continues (a digest; empty for none) and the prompt blocks the engine held already. A peer of the version before
writes the first four: read with no conversation."""
PlacementsCallback = Callable[[str, list[Placement]], None]
MAX_PLACEMENTS = 512
"""Placements one write carries (about 40 KB of JSON); more between two writes are dropped and counted."""
PLACEMENT_SLOTS = 8
"""Keys each replica's placements rotate through: eight writes would have to fall between two of the mesh's
broadcasts (30 ms apart) before a peer missed one."""
MAX_KEY_CHARS = 128
MAX_BLOCKS = 2**24


def parse_dispatch(key: str, text: str | None) -> tuple[str, list[int], float] | None:
    """(engine, own keys, expiry) of an ``approx`` bucket, or None when malformed or deleted."""
    engine, _, rest = key.partition(SEP)
    if not engine or text is None or rest.count(SEP) != 1:
        return None
    expiry_text, _, packed = text.partition(":")
    try:
        expiry = float(expiry_text)
        raw = base64.b64decode(packed, validate=True)
    except (ValueError, binascii.Error):
        return None
    if expiry != expiry or len(raw) % 8 or len(raw) > 8 * MAX_BUCKET_KEYS:
        return None
    return engine, np.frombuffer(raw, dtype="<u8").tolist(), expiry


def pack_dispatch(own_keys: Iterable[int], expires_at: float) -> str:
    return f"{expires_at:.3f}:" + base64.b64encode(np.fromiter(own_keys, dtype="<u8").tobytes()).decode("ascii")


class DispatchBuckets:
    """This replica's dispatched blocks per engine, packed by expiry bucket until the next flush (sans-IO)."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, int], tuple[float, dict[int, None]]] = {}
        self._expiry: dict[str, dict[int, float]] = {}
        """Per engine, the expiry each shared block has (to skip blocks shared recently enough)."""
        self._dirty: set[tuple[str, int]] = set()
        self.dropped = 0

    def add(self, engine: str, own_keys: Iterable[int], now: float, ttl_s: float) -> int:
        """Blocks sent to ``engine`` now, shared for ``ttl_s``; returns how many were added (blocks whose
        shared entry outlives half the TTL are skipped: a hot prefix costs one entry per half TTL)."""
        width = ttl_s / BUCKETS_PER_TTL
        bucket = math.ceil((now + ttl_s) / width)
        expires_at = bucket * width
        expiry = self._expiry.setdefault(engine, {})
        keys = self._buckets.setdefault((engine, bucket), (expires_at, {}))[1]
        added = 0
        for own_key in own_keys:
            if expiry.get(own_key, 0.0) >= now + ttl_s / 2 or own_key in keys:
                continue
            if len(keys) >= MAX_BUCKET_KEYS:
                self.dropped += 1
                continue
            keys[own_key] = None
            expiry[own_key] = expires_at
            added += 1
        if added:
            self._dirty.add((engine, bucket))
        return added

    def flush(self, now: float) -> list[tuple[str, int, str | None]]:
        """(engine, bucket, packed value or None to delete) of every bucket that changed or expired."""
        out: list[tuple[str, int, str | None]] = []
        for (engine, bucket), (expires_at, keys) in list(self._buckets.items()):
            if expires_at <= now:
                del self._buckets[engine, bucket]
                self._dirty.discard((engine, bucket))
                out.append((engine, bucket, None))
                expiry = self._expiry.get(engine, {})
                for own_key in keys:
                    if expiry.get(own_key) == expires_at:
                        del expiry[own_key]
        for engine, bucket in sorted(self._dirty):
            expires_at, keys = self._buckets[engine, bucket]
            out.append((engine, bucket, pack_dispatch(keys, expires_at)))
        self._dirty.clear()
        return out


class PlacementOutbox:
    """This replica's placements since its last write (sans-IO), numbered so a peer applies each write once."""

    def __init__(self) -> None:
        self._pending: list[Placement] = []
        self.sequence = 0
        self.dropped = 0

    def add(self, placement: Placement) -> bool:
        """Queue ``placement``; True when it is the first since the last write (a write is due)."""
        if len(self._pending) >= MAX_PLACEMENTS:
            self.dropped += 1
            return False
        self._pending.append(placement)
        return len(self._pending) == 1

    def flush(self) -> tuple[str, str] | None:
        """The slot and value to write (None: nothing placed since the last one)."""
        if not self._pending:
            return None
        self.sequence += 1
        text = f"{self.sequence}:" + json.dumps(self._pending, separators=(",", ":"))
        self._pending = []
        return str(self.sequence % PLACEMENT_SLOTS), text


class AppliedWrites:
    """Which of each peer's placement writes were applied here (sans-IO): each once, in whatever order its slots
    arrive, and none older than the last ``PLACEMENT_SLOTS`` (a slot's earlier value, seen again in a snapshot)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, set[int]]] = {}

    def first_time(self, replica: str, sequence: int) -> bool:
        highest, seen = self._seen.get(replica, (0, set()))
        if sequence <= highest - PLACEMENT_SLOTS or sequence in seen:
            return False
        highest = max(highest, sequence)
        self._seen[replica] = (highest, {s for s in seen if s > highest - PLACEMENT_SLOTS} | {sequence})
        return True

    def forget(self, replica: str) -> None:
        self._seen.pop(replica, None)


def placement_writer(key: str) -> str:
    """The replica a ``homes`` key belongs to (a peer of an earlier version writes its id alone)."""
    return key.partition(SEP)[0]


def _count(value: Any, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= high


def parse_placements(text: str | None) -> tuple[int, list[Placement]] | None:
    """(sequence, placements) of a ``homes`` value, or None when deleted or malformed (a peer's value is
    untrusted: every field is checked, and one bad placement refuses the whole write)."""
    if text is None or len(text) > MAX_JSON_BYTES:
        return None
    head, _, body = text.partition(":")
    if not head.isdigit():
        return None
    try:
        listed = parse_json(body)
    except ValueError:
        return None
    if not isinstance(listed, list) or len(listed) > MAX_PLACEMENTS:
        return None
    out: list[Placement] = []
    for item in listed:
        if not (isinstance(item, list) and len(item) in (4, 6)):
            return None
        key, engine, blocks, capacity, session, shared = item if len(item) == 6 else [*item, "", 0]
        if not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS and isinstance(engine, str) and engine
                and len(engine) <= MAX_KEY_CHARS and SEP not in engine and _count(blocks, MAX_BLOCKS)
                and (capacity is None or _count(capacity, MAX_BLOCKS)) and isinstance(session, str)
                and len(session) <= MAX_KEY_CHARS and (shared == 0 or _count(shared, MAX_BLOCKS))):
            return None
        out.append((key, engine, blocks, capacity, session, shared))
    return int(head), out


def parse_json(text: str) -> Any:
    """A registry or limits value; ValueError when oversized, not JSON, or nested too deep."""
    if len(text) > MAX_JSON_BYTES:
        raise ValueError("value too large")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("value nested too deep") from None


def _check_engine(engine: str) -> None:
    if SEP in engine:
        raise ValueError(f"engine id {engine!r} contains the key separator")


class MeshState:
    """The router's replicated state on one mesh node: typed writes, parsed change callbacks."""

    def __init__(self, node: MeshNode) -> None:
        self.node = node
        self.malformed: Counter[str] = Counter()
        self.task_failures: Counter[tuple[str, str]] = Counter()
        """Failures of the tasks writing this replica's state (gateway/mesh_link.py), by task and exception type."""
        self._registry: list[RegistryCallback] = []
        self._dispatch: list[DispatchCallback] = []
        self._limits: list[LimitsCallback] = []
        self._placements: list[PlacementsCallback] = []
        self._placed = PlacementOutbox()
        self._applied = AppliedWrites()
        self.on_placement_due: Callable[[], None] | None = None
        """Called when a placement is queued after a write (the mesh link then writes soon)."""
        self._outbox = DispatchBuckets()
        node.subscribe(self._on_changes)

    @property
    def content(self) -> dict[str, dict[str, str]]:
        return self.node.doc.content

    # ----- engine registry -------------------------------------------------------------------------

    def set_registry(self, engine: str, state: dict[str, Any] | None) -> None:
        """Set (or with None, drop) an engine's admin state: url, drain, maintenance, island label."""
        _check_engine(engine)
        self.node.write([("registry", engine, None if state is None else json.dumps(state, sort_keys=True))])

    def registry(self) -> dict[str, dict[str, Any]]:
        return self._decoded("registry", self.content["registry"].items())

    def sweep_tombstones(self, removed_before: float) -> int:
        """Delete the entries of engines removed before ``removed_before`` (unix seconds); a tombstone
        without a valid time (an older writer's) counts as removed long ago."""
        old = []
        for engine, state in self.registry().items():
            if state.get("removed") is True:
                at = state.get("removed_at")
                valid = isinstance(at, int | float) and not isinstance(at, bool) and at == at
                if not valid or at < removed_before:
                    old.append(engine)
        return len(self.node.write(("registry", engine, None) for engine in old)) if old else 0

    def on_registry(self, callback: RegistryCallback) -> None:
        """Call ``callback(engine_id, state or None)`` whenever an engine's admin state changes anywhere."""
        self._registry.append(callback)

    # ----- dispatch entries ------------------------------------------------------------------------

    def publish_dispatch(self, engine: str, own_keys: Iterable[int], now: float, ttl_s: float) -> int:
        """Share blocks this replica just sent to ``engine`` (``now`` in unix seconds) at the next
        :meth:`flush_dispatches`; returns how many are new."""
        _check_engine(engine)
        return self._outbox.add(engine, own_keys, now, ttl_s)

    def flush_dispatches(self, now: float) -> int:
        """Write this replica's changed buckets (one document key each) and delete its expired ones."""
        ops = [("approx", f"{engine}{SEP}{self.node.member_id}{SEP}{bucket}", value)
               for engine, bucket, value in self._outbox.flush(now)]
        return len(self.node.write(ops)) if ops else 0

    def sweep_dispatches(self, now: float) -> int:
        """Delete expired buckets of any replica, a departed one's too (the mesh's leader does this)."""
        expired = [key for key, text in self.content["approx"].items()
                   if (parsed := parse_dispatch(key, text)) is None or parsed[2] <= now]
        return len(self.node.write(("approx", key, None) for key in expired)) if expired else 0

    def on_dispatch(self, callback: DispatchCallback) -> None:
        """Call ``callback(engine, own_keys, expires_at)`` for every dispatch bucket any replica shares."""
        self._dispatch.append(callback)

    # ----- placements (prefix homes) --------------------------------------------------------------------

    def publish_placement(self, placement: Placement) -> None:
        """Share a request this replica placed, at the next :meth:`flush_placements`."""
        if self._placed.add(placement) and self.on_placement_due is not None:
            self.on_placement_due()

    def flush_placements(self) -> int:
        """Write the placements since the last flush (into the next of the replica's ``PLACEMENT_SLOTS`` keys)."""
        written = self._placed.flush()
        if written is None:
            return 0
        slot, text = written
        return len(self.node.write([("homes", f"{self.node.member_id}{SEP}{slot}", text)]))

    def sweep_placements(self, live: Iterable[str]) -> int:
        """Delete the placements of replicas no longer live (the mesh's leader does this)."""
        alive = set(live)
        gone = [key for key in self.content["homes"] if placement_writer(key) not in alive]
        return len(self.node.write(("homes", key, None) for key in gone)) if gone else 0

    def on_placements(self, callback: PlacementsCallback) -> None:
        """Call ``callback(replica, placements)`` once for every placements write of another replica."""
        self._placements.append(callback)

    @property
    def placements_dropped(self) -> int:
        return self._placed.dropped

    @property
    def dispatch_dropped(self) -> int:
        """Dispatched blocks not shared because their expiry bucket was full."""
        return self._outbox.dropped

    # ----- rate-limit counts -----------------------------------------------------------------------

    def set_limits(self, payload: Any) -> None:
        """Publish this replica's rate-limit counts (gateway/admission/ratelimit.py export format)."""
        self.node.write([("limits", self.node.member_id, json.dumps(payload, sort_keys=True))])

    def on_peer_limits(self, callback: LimitsCallback) -> None:
        """Call ``callback(replica_id, payload)`` when another replica publishes its rate-limit counts."""
        self._limits.append(callback)

    def live_members(self) -> list[str]:
        return self.node.live_members()

    # ----- autoscaler lease and state --------------------------------------------------------------

    def lease(self) -> str | None:
        """The autoscaler's lease as written (parse with autoscale.lease.Lease.from_json)."""
        return self.content["autoscaler"].get("lease")

    def write_lease(self, text: str) -> None:
        self.node.write([("autoscaler", "lease", text)])

    def members(self) -> str | None:
        """The autoscaler's member list as written (parse with autoscale.lease.parse_members)."""
        return self.content["autoscaler"].get("members")

    def write_members(self, members: list[str]) -> None:
        self.node.write([("autoscaler", "members", json.dumps(members))])

    def autoscaler_entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        """The autoscaler's JSON objects whose keys start with ``prefix`` (malformed ones are counted)."""
        return self._decoded("autoscaler", ((k, v) for k, v in self.content["autoscaler"].items()
                                            if k.startswith(prefix)))

    def set_autoscaler_entry(self, key: str, value: dict[str, Any] | None) -> None:
        self.node.write([("autoscaler", key, None if value is None else json.dumps(value, sort_keys=True))])

    # ----- change feed -----------------------------------------------------------------------------

    def _on_changes(self, changes: list[Change]) -> None:
        for name, key, _old, new in changes:
            if name == "approx" and new is not None:
                dispatch = parse_dispatch(key, new)
                if dispatch is None:
                    self.malformed["dispatch"] += 1
                    continue
                self._notify(self._dispatch, *dispatch)
            elif name == "homes" and (writer := placement_writer(key)) != self.node.member_id:
                if new is None:  # the replica left and the leader swept its keys
                    self._applied.forget(writer)
                else:
                    self._on_placements(writer, new)
            elif name == "limits" and key != self.node.member_id and new is not None:
                try:
                    payload = parse_json(new)
                except ValueError:
                    self.malformed["limits"] += 1
                    continue
                self._notify(self._limits, key, payload)
            elif name == "registry":
                try:
                    state = None if new is None else parse_json(new)
                except ValueError:
                    self.malformed["registry"] += 1
                    continue
                if state is not None and not isinstance(state, dict):
                    self.malformed["registry"] += 1
                    continue
                self._notify(self._registry, key, state)

    def _on_placements(self, replica: str, text: str) -> None:
        parsed = parse_placements(text)
        if parsed is None:
            self.malformed["homes"] += 1
            return
        sequence, placements = parsed
        if not self._applied.first_time(replica, sequence):
            return
        self._notify(self._placements, replica, placements)

    def _notify(self, callbacks: list[Callable[..., None]], *args: Any) -> None:
        """One callback that raises is logged and counted; the others and replication go on."""
        for callback in callbacks:
            try:
                callback(*args)
            except Exception:
                self.malformed["callback_errors"] += 1
                log.exception("mesh state callback %r failed", callback)

    def _decoded(self, name: str, items: Iterable[tuple[str, str]]) -> dict[str, Any]:
        result = {}
        for key, text in items:
            try:
                value = parse_json(text)
            except ValueError:
                self.malformed[name] += 1
                continue
            if isinstance(value, dict):
                result[key] = value
            else:
                self.malformed[name] += 1
        return result
