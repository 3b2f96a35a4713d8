"""The trio edge of membership: a UDP socket, timers and authentication around :class:`mesh.swim.Swim`.

Run :meth:`Membership.run` in the process's nursery (``await nursery.start(membership.run)``); it binds,
joins through the seeds, and serves until :meth:`Membership.leave` or cancellation (both broadcast a
graceful leave). ``python -m mesh.gossip`` runs a membership alone and prints its view changes as
JSON lines: the multi-process tests and the quick start use it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import secrets
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterable

import trio
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

from mesh.auth import AuthError, MeshAuth, load_secret
from mesh.seeds import RedisSeedRegistry, format_hostport, parse_hostport, parse_seeds, run_seed_registry
from mesh.settings import MeshSettings
from mesh.swim import MalformedMessage, Member, MemberEvent, Record, State, Swim

log = logging.getLogger(__name__)

GOSSIP_DOMAIN = "gossip"
MAX_DATAGRAM = 65_507
LEAVE_COPIES = 2
MAX_ADDR_CACHE = 4096
"""Parsed gossip addresses kept; members come and go with new addresses, so the cache is bounded."""

MEMBERS = Gauge("kvmesh_mesh_members", "Peers in this replica's membership view by state", ["state"])
PACKETS = PromCounter("kvmesh_mesh_gossip_packets_total", "Gossip datagrams by outcome", ["outcome"])


class Membership:
    """One replica's live view of the mesh, kept current by SWIM gossip over authenticated UDP."""

    def __init__(self, config: MeshSettings, member_id: str | None = None, replication_addr: str = "") -> None:
        """``member_id`` lets a caller that must know the id before joining (the replicated document
        is keyed by it) choose it; by default it is the name plus a random suffix, unique per start.
        ``replication_addr`` is what the replica advertises for its replication channel."""
        self.config = config
        self.replication_addr = replication_addr
        self.member_id = member_id or f"{config.name}-{secrets.token_hex(4)}"
        self.stats: Counter[str] = Counter()
        self._auth = MeshAuth(config.secret, self.member_id, domain=GOSSIP_DOMAIN)
        self._swim: Swim | None = None
        self._sock: trio.socket.SocketType | None = None
        self._send_lock = trio.Lock()
        self._wake = trio.Event()
        self._subscribers: list[trio.MemorySendChannel[MemberEvent]] = []
        self._blocked: set[str] = set()
        self._addr_cache: dict[str, tuple[str, int]] = {}
        self._cancel_scope: trio.CancelScope | None = None
        self._left = False

    # ----- public view ---------------------------------------------------------------------------

    @property
    def self_member(self) -> Member:
        return self._running_swim().me

    def live_members(self) -> list[Member]:
        """Self plus every peer alive or suspect, sorted by id."""
        return self._running_swim().live_members()

    def members(self) -> dict[str, Record]:
        """Every known peer with its state and incarnation (dead/left ones are retained for a while)."""
        return self._running_swim().records()

    @property
    def incarnation(self) -> int:
        return self._running_swim().incarnation

    def subscribe(self, max_buffer: int = 1024) -> trio.MemoryReceiveChannel[MemberEvent]:
        """A channel of view changes; if the reader falls behind, events are dropped and counted
        (``stats["events_dropped"]``), so readers that must not miss one reconcile with live_members()."""
        send, receive = trio.open_memory_channel[MemberEvent](max_buffer)
        self._subscribers.append(send)
        return receive

    def block_peers(self, peers: Iterable[str]) -> None:
        """Fault injection: drop traffic to and from these member ids or gossip addresses."""
        self._blocked |= set(peers)

    def unblock_all(self) -> None:
        self._blocked.clear()

    def _running_swim(self) -> Swim:
        if self._swim is None:
            raise RuntimeError("membership is not running yet: start Membership.run first")
        return self._swim

    # ----- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Membership] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, join and serve until :meth:`leave` or cancellation; reports ``self`` when bound."""
        cfg = self.config
        host, port = parse_hostport(cfg.bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
            await sock.bind((host, port))
            bound_port = sock.getsockname()[1]
            advertise = cfg.advertise or format_hostport(host, bound_port)
            if parse_hostport(advertise)[0] in ("0.0.0.0", "::"):
                raise ValueError("binding a wildcard address needs an explicit advertise address")
            me = Member(self.member_id, advertise, self.replication_addr, cfg.http_addr, cfg.island)
            self._sock = sock
            self._swim = Swim(me, cfg.swim, random.Random(), now=trio.current_time())
            self._swim.set_seeds(cfg.seeds)
            try:
                async with trio.open_nursery() as nursery:
                    self._cancel_scope = nursery.cancel_scope
                    nursery.start_soon(self._receive_loop)
                    nursery.start_soon(self._timer_loop)
                    if cfg.redis_url:
                        registry = RedisSeedRegistry(cfg.redis_url, cfg.cluster, me.id, cfg.redis_seed_ttl,
                                                     secret=cfg.secret)
                        await nursery.start(
                            run_seed_registry, registry, advertise, self._use_discovered_seeds, self.stats
                        )
                    task_status.started(self)
            finally:
                with trio.move_on_after(1.0) as scope:
                    scope.shield = True
                    await self._broadcast_leave()
                for subscriber in self._subscribers:
                    subscriber.close()

    async def leave(self) -> None:
        """Tell every peer we are going (they drop us at once instead of suspecting us), then stop."""
        await self._broadcast_leave()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    async def _broadcast_leave(self) -> None:
        if self._left or self._swim is None:
            return
        self._left = True
        self._swim.leave(trio.current_time())
        outgoing = self._swim.take_outgoing()
        for _ in range(LEAVE_COPIES):
            for out in outgoing:
                await self._send_one(out.addr, out.kind, out.payload)

    def _use_discovered_seeds(self, discovered: list[str]) -> None:
        self._running_swim().set_seeds([*self.config.seeds, *discovered])
        self._wake.set()

    # ----- I/O loops -----------------------------------------------------------------------------

    async def _timer_loop(self) -> None:
        swim = self._running_swim()
        while True:
            with trio.move_on_at(swim.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()
            swim.tick(trio.current_time())
            await self._after_change()

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, source = await self._sock.recvfrom(MAX_DATAGRAM)
            except OSError as exc:
                self._count("recv_errors")
                log.debug("gossip recvfrom failed: %s", exc)
                continue
            self._handle(data, format_hostport(source[0], source[1]))
            await self._after_change()
            self._wake.set()

    def _handle(self, data: bytes, source: str) -> None:
        if source in self._blocked:
            self._count("blocked")
            return
        try:
            envelope = self._auth.open(data, time.time())
        except AuthError:
            self._count("auth_failures")
            return
        if envelope.sender_id in self._blocked:
            self._count("blocked")
            return
        try:
            self._running_swim().receive(
                envelope.kind, envelope.payload, envelope.sender_id, trio.current_time()
            )
        except MalformedMessage as exc:
            self._count("malformed")
            log.debug("malformed gossip from %s: %s", envelope.sender_id, exc)
            return
        self._count("received")

    async def _after_change(self) -> None:
        swim = self._running_swim()
        for event in swim.take_events():
            self._publish(event)
        for out in swim.take_outgoing():
            await self._send_one(out.addr, out.kind, out.payload)

    async def _send_one(self, addr: str, kind: int, payload: object) -> None:
        if self._blocked and (addr in self._blocked or self._member_id_at(addr) in self._blocked):
            self._count("blocked")
            return
        packet = self._auth.seal(kind, payload, time.time(), recipient=self._recipient_at(addr))
        if len(packet) > MAX_DATAGRAM:
            self._count("oversize")
            return
        try:
            if len(self._addr_cache) > MAX_ADDR_CACHE:
                self._addr_cache.clear()
            target = self._addr_cache.get(addr) or self._addr_cache.setdefault(addr, parse_hostport(addr))
            async with self._send_lock:
                assert self._sock is not None
                await self._sock.sendto(packet, target)
        except (OSError, ValueError) as exc:
            self._count("send_errors")
            log.debug("gossip send to %s failed: %s", addr, exc)
            return
        self._count("sent")

    def _recipient_at(self, addr: str) -> str | None:
        """The live member at ``addr``, whom the packet is sealed for (a copy replayed to another member then
        fails); None for a seed not known yet, or when a restarted member may answer there under a new id."""
        live = [m.id for m in self._running_swim().live_members() if m.gossip_addr == addr]
        return live[0] if len(live) == 1 else None

    def _member_id_at(self, addr: str) -> str | None:
        for member_id, record in self._running_swim().records().items():
            if record.member.gossip_addr == addr:
                return member_id
        return None

    def _publish(self, event: MemberEvent) -> None:
        states = Counter(r.state for r in self._running_swim().records().values())
        for state in State:
            MEMBERS.labels(state.name.lower()).set(states[state])
        for subscriber in list(self._subscribers):
            try:
                subscriber.send_nowait(event)
            except trio.WouldBlock:
                self._count("events_dropped")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(subscriber)

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        PACKETS.labels(outcome).inc()


# ----- stand-alone runner --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mesh.gossip", description="Run one mesh member alone.")
    p.add_argument("--name", default="router")
    p.add_argument("--mesh-bind", default="127.0.0.1:0")
    p.add_argument("--advertise")
    p.add_argument("--seeds", default="", type=parse_seeds)
    p.add_argument("--mesh-secret-file", required=True)
    p.add_argument("--island", default="")
    p.add_argument("--replication-addr", default="")
    p.add_argument("--http-addr", default="")
    p.add_argument("--cluster", default="kvmesh")
    p.add_argument("--redis-url")
    p.add_argument("--redis-seed-ttl", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=math.inf, help="stop (with a leave) after this many s")
    return p


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def _serve(config: MeshSettings, replication_addr: str, duration: float) -> None:
    membership = Membership(config, replication_addr=replication_addr)
    async with trio.open_nursery() as nursery:
        await nursery.start(membership.run)
        me = membership.self_member
        _emit(event="ready", id=me.id, addr=me.gossip_addr, t=time.monotonic())

        async def report(events: trio.MemoryReceiveChannel[MemberEvent]) -> None:
            async for ev in events:
                _emit(event=ev.kind, member=ev.member.id, incarnation=ev.incarnation, t=time.monotonic())

        nursery.start_soon(report, membership.subscribe())
        with (
            trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            trio.move_on_after(duration),
        ):
            async for _ in signals:
                break
        await membership.leave()
    live = [m.id for m in membership.live_members() if m.id != membership.member_id]
    _emit(event="stats", live=live, incarnation=membership.incarnation, **membership.stats)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mesh.gossip`` (and a possible ``kvmesh mesh-member`` subcommand)."""
    args = _parser().parse_args(argv)
    config = MeshSettings(
        secret=load_secret(args.mesh_secret_file),
        name=args.name,
        bind=args.mesh_bind,
        advertise=args.advertise,
        seeds=tuple(args.seeds),
        http_addr=args.http_addr,
        island=args.island,
        cluster=args.cluster,
        redis_url=args.redis_url,
        redis_seed_ttl=args.redis_seed_ttl,
    )
    trio.run(_serve, config, args.replication_addr, args.duration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
