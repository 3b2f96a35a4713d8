"""What a router replicates through the mesh's document, and how it reads it back (the router's adapter).

Namespaces (flat maps of string keys to string values, see mesh/crdt_doc.py):

- ``registry``: ``"<engine>"`` -> JSON engine config and admin state (url, events, drain, island, ...), or
                ``{"removed": true, "removed_at"}`` (deleted by the leader an hour later)
- ``approx``:   ``"<engine>\\x1f<own_key>"`` -> expiry (unix seconds) of a block some replica sent there
                (approximate entries of engines without events, speculative entries of the others)
- ``limits``:   ``"<replica>"`` -> JSON of that replica's windowed request/token counts per tenant
- ``autoscaler``: ``"lease"`` -> JSON lease (holder, expiry, term) and ``"members"`` -> JSON list of the
                replica ids quorum is counted against (autoscale/lease.py); ``"state"``,
                ``"pending:<request>"`` and ``"engine:<id>"`` -> JSON written by the lease holder

The block index itself is not here: every replica ingests every engine's KV events itself and a starting
replica takes a peer's index by state transfer (gateway/index_transfer.py). Each key has one writer at a
time (an admin action, the replica named in the key, or the replica that dispatched), so concurrent
writes to one key are rare.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from mesh.crdt_doc import SEP, Change
from mesh.node import MeshNode

log = logging.getLogger("kvmesh.mesh")

NAMESPACES = ("registry", "approx", "limits", "autoscaler")
MAX_JSON_BYTES = 64 * 1024
"""A registry or limits value larger than this is refused (a replica writes a few hundred bytes)."""

RegistryCallback = Callable[[str, dict[str, Any] | None], None]
DispatchCallback = Callable[[str, int, float], None]
LimitsCallback = Callable[[str, Any], None]


def _expiry(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_dispatch(key: str, text: str | None) -> tuple[str, int, float] | None:
    """(engine, own key, expiry) of an ``approx`` entry, or None when malformed or deleted."""
    engine, _, own = key.rpartition(SEP)
    if not engine or text is None or len(own) > 20:
        return None
    try:
        own_key, expiry = int(own), float(text)
    except ValueError:
        return None
    if not 0 <= own_key < 2**64 or expiry != expiry:
        return None
    return engine, own_key, expiry


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
        self._registry: list[RegistryCallback] = []
        self._dispatch: list[DispatchCallback] = []
        self._limits: list[LimitsCallback] = []
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

    def publish_dispatch(self, engine: str, own_keys: Iterable[int], expires_at: float,
                         refresh_before: float) -> int:
        """Share blocks this replica just sent to ``engine`` (until ``expires_at``, unix seconds).

        Only keys missing from the document, or due to expire before ``refresh_before``, are written, so
        a hot prefix costs one write per half TTL rather than one per request."""
        _check_engine(engine)
        current = self.content["approx"]
        ops = []
        for own_key in own_keys:
            key = f"{engine}{SEP}{own_key}"
            old = current.get(key)
            if old is None or _expiry(old) < refresh_before:
                ops.append(("approx", key, f"{expires_at:.3f}"))
        return len(self.node.write(ops)) if ops else 0

    def sweep_dispatches(self, now: float) -> int:
        """Delete expired dispatch entries (the mesh's leader does this)."""
        expired = [key for key, text in self.content["approx"].items() if _expiry(text) <= now]
        return len(self.node.write(("approx", key, None) for key in expired)) if expired else 0

    def on_dispatch(self, callback: DispatchCallback) -> None:
        """Call ``callback(engine, own_key, expires_at)`` for every dispatch entry any replica shares."""
        self._dispatch.append(callback)

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
