"""One router replica's whole mesh presence: membership, replication, ownership and snapshots in one object.

The router builds its index view on ``node.store`` and asks the node which engines' event streams it
must ingest. Start it with ``node = await nursery.start(MeshNode(settings).run)``; it starts, in this
order, a Redis snapshot load (bounded, only if ``redis_url``), the replication service, the gossip
membership (advertising the replication address), the snapshot writer (only if ``redis_url``), and the
ownership tracker. Everything runs in one nursery owned by :meth:`MeshNode.run`.

Ownership is rendezvous hashing over the live members (:mod:`mesh.ownership`). The tracker reconciles
every ``reconcile_interval`` against ``live_members()`` and also wakes on gossip events; it does not
rely on events alone because the event channel drops events when its reader falls behind.

``python -m mesh.node`` runs one node alone and prints JSON lines (ready, owned engines, view changes);
the multi-process tests use it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from index.replicated import ReplicatedIndex, parse_dispatch
from mesh.auth import load_secret
from mesh.gossip import Membership, MeshConfig
from mesh.ownership import owned_engines, owners
from mesh.seeds import format_hostport, parse_hostport, parse_seeds
from mesh.snapshots import RedisSnapshotStore, SnapshotWriter, load_into
from mesh.swim import MemberEvent, State, SwimConfig
from mesh.sync import SyncService
from mesh.sync_protocol import SyncProtocol

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::")
FINAL_SNAPSHOT_TIMEOUT_S = 1.0
DISPATCH_SWEEP_S = 5.0

SeqCallback = Callable[[str, int], None]
RegistryCallback = Callable[[str, dict[str, Any] | None], None]
PresenceCallback = Callable[[str, bool], None]


@dataclass(frozen=True, slots=True)
class MeshNodeSettings:
    """What a replica needs to join the mesh; addresses are ``host:port`` (port 0 = any free port)."""

    secret: bytes
    name: str = "router"
    bind: str = "127.0.0.1:7946"
    advertise: str | None = None
    seeds: tuple[str, ...] = ()
    replication_bind: str = "127.0.0.1:0"
    http_addr: str = ""
    island: str = ""
    cluster: str = "kvmesh"
    redis_url: str | None = None
    redundancy: int = 2
    snapshot_interval: float = 5.0
    reconcile_interval: float = 0.2
    anti_entropy_interval: float = 1.0
    swim: SwimConfig = field(default_factory=SwimConfig)

    def validate(self) -> None:
        if self.redundancy < 1:
            raise ValueError("redundancy must be at least 1")
        for name in ("snapshot_interval", "reconcile_interval", "anti_entropy_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for bind in (self.bind, self.replication_bind):
            if parse_hostport(bind)[0] in WILDCARDS and not self.advertise:
                raise ValueError(f"binding the wildcard address {bind} needs an explicit advertise address")
        for seed in self.seeds:
            parse_hostport(seed)


@dataclass(slots=True)
class _OwnershipWatcher:
    engine_ids: Callable[[], Iterable[str]]
    send: trio.MemorySendChannel[set[str]]
    delivered: set[str] | None = None


class MeshNode:
    """Membership + replicated index + ownership for one router replica (see the module docstring)."""

    def __init__(self, settings: MeshNodeSettings) -> None:
        settings.validate()
        self.settings = settings
        self.member_id = f"{settings.name}-{secrets.token_hex(4)}"
        self.store = ReplicatedIndex(self.member_id)
        self.protocol = SyncProtocol(self.store.doc)
        self.stats: Counter[str] = Counter()
        self.replication: SyncService | None = None
        self._membership: Membership | None = None
        self._snapshots: SnapshotWriter | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self._isolated = False
        self._watchers: list[_OwnershipWatcher] = []
        self._seq_callbacks: list[SeqCallback] = []
        self._registry_callbacks: list[RegistryCallback] = []
        self._presence_callbacks: list[PresenceCallback] = []
        self._limits_callbacks: list[Callable[[str, Any], None]] = []
        self._dispatch_callbacks: list[Callable[[str, int, float], None]] = []
        self._presence: dict[str, bool] = {}
        self._load_source: Callable[[], dict[str, int]] | None = None
        self.store.doc.subscribe(self._on_doc_changes)

    # ----- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[MeshNode] = trio.TASK_STATUS_IGNORED) -> None:
        """Start everything, report ``self`` once gossip and replication listen, serve until cancelled
        or :meth:`leave`."""
        s = self.settings
        snapshot_store = RedisSnapshotStore(s.redis_url, s.cluster) if s.redis_url else None
        try:
            if snapshot_store is not None:
                await load_into(snapshot_store, self.protocol, self.stats)
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                host, port = parse_hostport(s.replication_bind)
                self.replication = SyncService(
                    self.protocol,
                    s.secret,
                    self._replication_peers,
                    host=host,
                    port=port,
                    anti_entropy_interval=s.anti_entropy_interval,
                    drop=lambda _peer: self._isolated,
                    load_source=lambda: None if self._load_source is None else self._load_source(),
                )
                replication_port = await nursery.start(self.replication.run)
                membership = Membership(self._mesh_config(replication_port), member_id=self.member_id)
                events = membership.subscribe()
                self._membership = await nursery.start(membership.run)
                if snapshot_store is not None:
                    self._snapshots = SnapshotWriter(
                        snapshot_store, self.store.doc, self._is_snapshot_writer, self.stats, time.time
                    )
                    nursery.start_soon(self._snapshots.run, s.snapshot_interval)
                nursery.start_soon(self._ownership_loop, events)
                nursery.start_soon(self._sweep_dispatches)
                task_status.started(self)
        finally:
            for watcher in self._watchers:
                watcher.send.close()
            if snapshot_store is not None:
                snapshot_store.close()

    def _mesh_config(self, replication_port: int) -> MeshConfig:
        s = self.settings
        host = parse_hostport(s.advertise)[0] if s.advertise else parse_hostport(s.replication_bind)[0]
        return MeshConfig(
            secret=s.secret,
            name=s.name,
            bind=s.bind,
            advertise=s.advertise,
            seeds=tuple(s.seeds),
            replication_addr=format_hostport(host, replication_port),
            http_addr=s.http_addr,
            island=s.island,
            cluster=s.cluster,
            redis_url=s.redis_url,
            swim=s.swim,
        )

    async def leave(self) -> None:
        """Graceful leave: a last snapshot if this replica writes them, tell the peers, then stop."""
        if self._snapshots is not None:
            with trio.move_on_after(FINAL_SNAPSHOT_TIMEOUT_S):
                await self._snapshots.save_if_changed()
        if self._membership is not None:
            await self._membership.leave()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    # ----- membership ----------------------------------------------------------------------------

    def _running(self) -> Membership:
        if self._membership is None:
            raise RuntimeError("the mesh node is not running yet: start MeshNode.run first")
        return self._membership

    def live_members(self) -> list[str]:
        """Ids of the live members (self included, suspects included), sorted."""
        return [m.id for m in self._running().live_members()]

    def _replication_peers(self) -> dict[str, tuple[str, int]]:
        if self._membership is None:
            return {}
        peers = {}
        for member in self._membership.live_members():
            if member.id == self.member_id or not member.replication_addr:
                continue
            try:
                peers[member.id] = parse_hostport(member.replication_addr)
            except ValueError:
                self.stats["bad_replication_addr"] += 1
        return peers

    def _is_snapshot_writer(self) -> bool:
        return not self._isolated and self.member_id == min(self.live_members())

    # ----- ownership -----------------------------------------------------------------------------

    def owners(self, engine_id: str) -> list[str]:
        """The ``redundancy`` members that ingest ``engine_id``'s events, best first."""
        return owners(engine_id, self.live_members(), self.settings.redundancy)

    def is_owner(self, engine_id: str) -> bool:
        return self.member_id in self.owners(engine_id)

    def owner_present(self, engine_id: str) -> bool:
        """False while every owner of ``engine_id`` is suspected (probably dead but not yet replaced):
        nobody is ingesting its events, so the confidence in its index entries must decay."""
        return self._owner_present(engine_id, self.live_members(), self._alive_ids())

    def _alive_ids(self) -> set[str]:
        records = self._running().members()
        return {self.member_id, *(m for m, r in records.items() if r.state == State.ALIVE)}

    def _owner_present(self, engine_id: str, live: list[str], alive: set[str]) -> bool:
        return any(owner in alive for owner in owners(engine_id, live, self.settings.redundancy))

    def watch_ownership(
        self, engine_ids: Callable[[], Iterable[str]]
    ) -> trio.MemoryReceiveChannel[set[str]]:
        """A channel that receives the set of engines (among ``engine_ids()``) this replica owns, at once
        and then whenever it changes. It holds one value; a slow reader gets the newest set next."""
        send, receive = trio.open_memory_channel[set[str]](1)
        self._watchers.append(_OwnershipWatcher(engine_ids, send))
        if self._membership is not None:
            self._reconcile()
        return receive

    def known_engines(self) -> set[str]:
        """Every engine the replicated document mentions (blocks, seqs or registry)."""
        content = self.store.doc.content
        return set(self.store.engines()) | set(content["seq"]) | set(content["registry"])

    def resume_seq(self, engine_id: str) -> int | None:
        """The last event seq an owner applied for ``engine_id``: a new owner replays from seq + 1."""
        return self.store.seq(engine_id)

    async def _ownership_loop(self, events: trio.MemoryReceiveChannel[MemberEvent]) -> None:
        async with events:
            while True:
                with trio.move_on_after(self.settings.reconcile_interval):
                    try:
                        await events.receive()
                    except trio.EndOfChannel:
                        return
                    while True:
                        try:
                            events.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                self._reconcile()

    def _reconcile(self) -> None:
        """Deliver changed ownership sets, fire presence changes, and keep an isolation complete."""
        if self._isolated:
            self._block_everyone()
        live = self.live_members()
        redundancy = self.settings.redundancy
        watched: set[str] = set()
        for watcher in list(self._watchers):
            engines = set(watcher.engine_ids())
            watched |= engines
            owned = owned_engines(self.member_id, engines, live, redundancy)
            if owned == watcher.delivered:
                continue
            try:
                watcher.send.send_nowait(set(owned))
            except trio.WouldBlock:
                self.stats["ownership_updates_deferred"] += 1
                continue
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._watchers.remove(watcher)
                continue
            watcher.delivered = owned
        alive = self._alive_ids()
        for engine in sorted(watched | self.known_engines()):
            present = self._owner_present(engine, live, alive)
            if self._presence.get(engine, True) != present:
                self._notify(self._presence_callbacks, engine, present)
            self._presence[engine] = present

    # ----- replicated engine state ---------------------------------------------------------------

    def on_seq(self, callback: SeqCallback) -> None:
        """Call ``callback(engine_id, seq)`` whenever an engine's last applied seq changes in the
        document: from a remote owner's ingest, and from this replica's own ``store.set_seq``."""
        self._seq_callbacks.append(callback)

    def on_registry(self, callback: RegistryCallback) -> None:
        """Call ``callback(engine_id, state or None)`` whenever an engine's admin state changes anywhere."""
        self._registry_callbacks.append(callback)

    def on_owner_presence(self, callback: PresenceCallback) -> None:
        """Call ``callback(engine_id, present)`` when :meth:`owner_present` flips for a known engine."""
        self._presence_callbacks.append(callback)

    def on_dispatch(self, callback: Callable[[str, int, float], None]) -> None:
        """Call ``callback(engine, own_key, expires_at)`` for every dispatch entry any replica shares."""
        self._dispatch_callbacks.append(callback)

    async def _sweep_dispatches(self) -> None:
        """The lowest live member deletes expired dispatch entries, so the document does not keep them."""
        while True:
            await trio.sleep(DISPATCH_SWEEP_S)
            if not self._isolated and self.member_id == min(self.live_members()):
                self.store.sweep_dispatches(time.time())

    def share_load(self, source: Callable[[], dict[str, int]]) -> None:
        """Report ``source()`` (this replica's in-flight requests per engine) to the peers from now on."""
        self._load_source = source

    def peer_in_flight(self) -> dict[str, int]:
        """Per engine, the requests live peers have in flight there, as they last reported."""
        if self._membership is None:
            return {}
        return self.protocol.peer_load.totals(trio.current_time(), self.live_members())

    def on_peer_limits(self, callback: Callable[[str, Any], None]) -> None:
        """Call ``callback(replica_id, payload)`` when another replica publishes its rate-limit counts."""
        self._limits_callbacks.append(callback)

    def set_engine_state(self, engine_id: str, state: dict[str, Any] | None) -> None:
        """Set (None: remove) an engine's replicated admin state: drain, maintenance, island, ..."""
        self.store.set_registry(engine_id, state)

    def engine_states(self) -> dict[str, dict[str, Any]]:
        return self.store.registry()

    def _on_doc_changes(self, changes: list[tuple[str, str, str | None, str | None]]) -> None:
        for name, key, _old, new in changes:
            if name == "seq" and new is not None:
                try:
                    seq = int(new)
                except ValueError:
                    self.stats["malformed_seq"] += 1
                    continue
                self._notify(self._seq_callbacks, key, seq)
            elif name == "approx" and new is not None:
                dispatch = parse_dispatch(key, new)
                if dispatch is None:
                    self.stats["malformed_dispatch"] += 1
                    continue
                self._notify(self._dispatch_callbacks, *dispatch)
            elif name == "limits" and key != self.member_id and new is not None:
                try:
                    payload = json.loads(new)
                except ValueError:
                    self.stats["malformed_limits"] += 1
                    continue
                self._notify(self._limits_callbacks, key, payload)
            elif name == "registry":
                try:
                    state = None if new is None else json.loads(new)
                except ValueError:
                    self.stats["malformed_registry"] += 1
                    continue
                self._notify(self._registry_callbacks, key, state)

    def _notify(self, callbacks: list[Callable[..., None]], *args: Any) -> None:
        """Run subscriber callbacks; one that raises is logged and counted, never allowed to stop
        replication (these run inside the handling of a peer's frame)."""
        for callback in callbacks:
            try:
                callback(*args)
            except Exception:
                self.stats["callback_errors"] += 1
                log.exception("mesh callback %r failed", callback)

    # ----- fault injection -----------------------------------------------------------------------

    def isolate(self, isolated: bool) -> None:
        """Cut (True) or restore (False) this replica's gossip and replication with every peer."""
        self._isolated = isolated
        if isolated:
            self._block_everyone()
        else:
            self._running().unblock_all()

    @property
    def isolated(self) -> bool:
        return self._isolated

    def _block_everyone(self) -> None:
        membership = self._running()
        records = membership.members()
        membership.block_peers(
            [*records, *(r.member.gossip_addr for r in records.values()), *self.settings.seeds]
        )

    # ----- admin ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The mesh as this replica sees it, for ``GET /admin/mesh`` (plain JSON types only)."""
        membership = self._running()
        now = trio.current_time()
        me = membership.self_member
        members = [_member_json(me, "alive", membership.incarnation, None)]
        members += [
            _member_json(r.member, r.state.name.lower(), r.incarnation, now - r.since)
            for r in sorted(membership.members().values(), key=lambda r: r.member.id)
        ]
        engines = sorted(self.known_engines() | {e for w in self._watchers for e in w.engine_ids()})
        replication = self.replication
        assert replication is not None
        doc = self.store.doc
        return {
            "member_id": self.member_id,
            "isolated": self._isolated,
            "redundancy": self.settings.redundancy,
            "members": members,
            "owners": {e: self.owners(e) for e in engines},
            "owned": sorted(e for e in engines if self.is_owner(e)),
            "owner_missing": sorted(e for e in engines if not self.owner_present(e)),
            "epoch": {"number": doc.epoch.number, "owner": doc.epoch.owner},
            "live_keys": doc.live_keys(),
            "replication": {
                "connected": replication.connected_peers(),
                "seconds_since_heard": {p: now - t for p, t in sorted(replication.last_heard.items())},
                "transport": dict(replication.counters),
                "protocol": dict(self.protocol.counters),
            },
            "gossip": dict(membership.stats),
            "node": dict(self.stats),
        }


def _member_json(member: Any, state: str, incarnation: int, since_s: float | None) -> dict[str, Any]:
    return {
        "id": member.id,
        "state": state,
        "incarnation": incarnation,
        "gossip_addr": member.gossip_addr,
        "replication_addr": member.replication_addr,
        "http_addr": member.http_addr,
        "island": member.island,
        "state_for_s": since_s,
    }


# ----- stand-alone runner --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mesh.node", description="Run one mesh node alone.")
    p.add_argument("--name", default="router")
    p.add_argument("--mesh-bind", default="127.0.0.1:0")
    p.add_argument("--advertise")
    p.add_argument("--seeds", default="", type=parse_seeds)
    p.add_argument("--mesh-secret-file", required=True)
    p.add_argument("--replication-bind", default="127.0.0.1:0")
    p.add_argument("--http-addr", default="")
    p.add_argument("--island", default="")
    p.add_argument("--cluster", default="kvmesh")
    p.add_argument("--redis-url")
    p.add_argument("--redundancy", type=int, default=2)
    p.add_argument("--engines", default="", help="comma-separated engine ids whose ownership to report")
    p.add_argument("--duration", type=float, default=math.inf, help="stop (with a leave) after this many s")
    return p


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def _serve(settings: MeshNodeSettings, engines: list[str], duration: float) -> None:
    node = MeshNode(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        me = node.describe()["members"][0]
        _emit(event="ready", id=node.member_id, gossip=me["gossip_addr"], replication=me["replication_addr"])

        async def report(owned: trio.MemoryReceiveChannel[set[str]]) -> None:
            async for engine_set in owned:
                _emit(event="owned", engines=sorted(engine_set), live=node.live_members(), t=time.monotonic())

        nursery.start_soon(report, node.watch_ownership(lambda: engines))
        with (
            trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            trio.move_on_after(duration),
        ):
            async for _ in signals:
                break
        await node.leave()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mesh.node`` (and a possible ``kvmesh mesh-node`` subcommand)."""
    args = _parser().parse_args(argv)
    settings = MeshNodeSettings(
        secret=load_secret(args.mesh_secret_file),
        name=args.name,
        bind=args.mesh_bind,
        advertise=args.advertise,
        seeds=tuple(args.seeds),
        replication_bind=args.replication_bind,
        http_addr=args.http_addr,
        island=args.island,
        cluster=args.cluster,
        redis_url=args.redis_url,
        redundancy=args.redundancy,
    )
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    trio.run(_serve, settings, engines, args.duration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
