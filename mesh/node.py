"""One replica's mesh presence: membership, a replicated document of named maps, state transfer, snapshots.

The mesh is generic: it knows peers and namespaces, not what a router keeps in them (that is
gateway/mesh_state.py). Start it with ``node = await nursery.start(MeshNode(settings, namespaces).run)``;
it starts, in this order, a Redis snapshot load (bounded, only if ``redis_url``), the replication service,
the gossip membership (advertising the replication address) and the snapshot writer (only if
``redis_url``). Everything runs in one nursery owned by :meth:`MeshNode.run`.

``python -m mesh.node`` runs one node alone and prints JSON lines (ready, then the live members whenever
they change); the multi-process tests use it.
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
from typing import Any

import trio

from mesh.auth import load_secret
from mesh.crdt_doc import Change, Op, ReplicatedDoc
from mesh.gossip import Membership
from mesh.seeds import format_hostport, parse_hostport, parse_seeds
from mesh.settings import MeshSettings
from mesh.snapshots import RedisSnapshotStore, SnapshotWriter, load_into
from mesh.swim import MemberEvent, State
from mesh.sync import SyncService
from mesh.sync_protocol import StateProvider, SyncProtocol

log = logging.getLogger(__name__)

FINAL_SNAPSHOT_TIMEOUT_S = 1.0


class MeshNode:
    """Membership + replicated document + state transfer for one replica (see the module docstring)."""

    def __init__(self, settings: MeshSettings, namespaces: Iterable[str]) -> None:
        settings.validate()
        self.settings = settings
        self.member_id = f"{settings.name}-{secrets.token_hex(4)}"
        self.doc = ReplicatedDoc(self.member_id, namespaces)
        self.protocol = SyncProtocol(self.doc)
        self.stats: Counter[str] = Counter()
        self.replication: SyncService | None = None
        self._membership: Membership | None = None
        self._snapshots: SnapshotWriter | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self._isolated = False
        self._view_watchers: list[trio.MemorySendChannel[list[str]]] = []
        self._load_source: Callable[[], dict[str, int]] | None = None

    # ----- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[MeshNode] = trio.TASK_STATUS_IGNORED) -> None:
        """Start everything, report ``self`` once gossip and replication listen, serve until cancelled
        or :meth:`leave`."""
        s = self.settings
        snapshot_store = RedisSnapshotStore(s.redis_url, s.cluster, secret=s.secret) if s.redis_url else None
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
                membership = Membership(s, member_id=self.member_id,
                                        replication_addr=self._replication_addr(replication_port))
                events = membership.subscribe()
                self._membership = await nursery.start(membership.run)
                if snapshot_store is not None:
                    self._snapshots = SnapshotWriter(
                        snapshot_store, self.doc, self.is_leader, self.stats, time.time
                    )
                    nursery.start_soon(self._snapshots.run, s.snapshot_interval)
                nursery.start_soon(self._view_loop, events)
                task_status.started(self)
        finally:
            for watcher in self._view_watchers:
                watcher.close()
            if snapshot_store is not None:
                snapshot_store.close()

    def _replication_addr(self, replication_port: int) -> str:
        s = self.settings
        host = parse_hostport(s.advertise)[0] if s.advertise else parse_hostport(s.replication_bind)[0]
        return format_hostport(host, replication_port)

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

    def alive_members(self) -> set[str]:
        """Ids of the members not even suspected (self included)."""
        records = self._running().members()
        return {self.member_id, *(m for m, r in records.items() if r.state == State.ALIVE)}

    def departed_members(self) -> set[str]:
        """Ids of the members known to have left gracefully (retained for a while after they left)."""
        return {m for m, r in self._running().members().items() if r.state == State.LEFT}

    def is_leader(self) -> bool:
        """True on exactly one connected replica: the lowest live member id (snapshots, sweeps)."""
        return not self._isolated and self._membership is not None and self.member_id == min(self.live_members())

    def watch_view(self) -> trio.MemoryReceiveChannel[list[str]]:
        """A channel that receives the live members at once and whenever they change; it holds one value,
        so a slow reader gets the newest view next."""
        send, receive = trio.open_memory_channel[list[str]](1)
        self._view_watchers.append(send)
        if self._membership is not None:
            send.send_nowait(self.live_members())
        return receive

    async def _view_loop(self, events: trio.MemoryReceiveChannel[MemberEvent]) -> None:
        """Keep an isolation complete and tell view watchers; reconciles every 0.2 s too, since the event
        channel drops events when its reader falls behind."""
        delivered: list[str] | None = None
        async with events:
            while True:
                with trio.move_on_after(0.2):
                    try:
                        await events.receive()
                    except trio.EndOfChannel:
                        return
                if self._isolated:
                    self._block_everyone()
                view = self.live_members()
                if view == delivered:
                    continue
                for watcher in list(self._view_watchers):
                    try:
                        watcher.send_nowait(view)
                    except trio.WouldBlock:
                        self.stats["view_updates_deferred"] += 1
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._view_watchers.remove(watcher)
                delivered = view

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

    # ----- the replicated document -----------------------------------------------------------------

    def subscribe(self, callback: Callable[[list[Change]], None]) -> None:
        """Call ``callback`` with every batch of document changes, local or remote. A callback that raises
        is logged and counted, never allowed to stop replication (it runs inside a peer frame's handling)."""

        def guarded(changes: list[Change]) -> None:
            try:
                callback(changes)
            except Exception:
                self.stats["callback_errors"] += 1
                log.exception("mesh subscriber %r failed", callback)

        self.doc.subscribe(guarded)

    def write(self, ops: Iterable[Op]) -> list[Change]:
        """Write local ops into the document (replicated with the next broadcast)."""
        return self.doc.write(ops)

    # ----- state transfer ------------------------------------------------------------------------

    def serve_state(self, namespace: str, provider: StateProvider) -> None:
        """Answer peers' state queries for ``namespace`` (see mesh/sync_protocol.py)."""
        self.protocol.serve_state(namespace, provider)

    async def fetch_state(self, namespace: str, key: str, timeout_s: float) -> dict[str, bytes | None]:
        """Ask every connected peer for its state of ``key``; returns the complete answers (None: the peer
        holds nothing) once every asked peer answered, or what arrived by ``timeout_s``."""
        if self.replication is None or self._isolated:
            return {}
        request_id, query = self.protocol.state_query_frame(namespace, key)
        try:
            asked = self.replication.send_to_all(query)
            deadline = trio.current_time() + timeout_s
            while asked and trio.current_time() < deadline:
                answers = self.protocol.transfers.answers(request_id)
                if asked <= set(answers):
                    return answers
                await trio.sleep(0.02)
            return self.protocol.transfers.answers(request_id)
        finally:
            self.protocol.transfers.close(request_id)

    def share_load(self, source: Callable[[], dict[str, int]]) -> None:
        """Report ``source()`` (this replica's in-flight requests per engine) to the peers from now on."""
        self._load_source = source

    def peer_in_flight(self) -> dict[str, int]:
        """Per engine, the requests live peers have in flight there, as they last reported."""
        if self._membership is None:
            return {}
        return self.protocol.peer_load.totals(trio.current_time(), self.live_members())

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
        replication = self.replication
        assert replication is not None
        doc = self.doc
        return {
            "member_id": self.member_id,
            "isolated": self._isolated,
            "members": members,
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
    p.add_argument("--duration", type=float, default=math.inf, help="stop (with a leave) after this many s")
    return p


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def _serve(settings: MeshSettings, duration: float) -> None:
    node = MeshNode(settings, namespaces=())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        me = node.describe()["members"][0]
        _emit(event="ready", id=node.member_id, gossip=me["gossip_addr"], replication=me["replication_addr"])

        async def report(views: trio.MemoryReceiveChannel[list[str]]) -> None:
            async for view in views:
                _emit(event="view", live=view, t=time.monotonic())

        nursery.start_soon(report, node.watch_view())
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
    settings = MeshSettings(
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
    )
    trio.run(_serve, settings, args.duration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
