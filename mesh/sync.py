"""Replication transport (trio): authenticated, length-prefixed frames over TCP between replicas.

Each replica dials every live peer (one outbound connection per peer) and accepts the peers' dials.
Outbound connections carry the batched update broadcast (every ``flush_interval``), this replica's
in-flight requests per engine (when they change, checked every ``load_interval``) and periodic
anti-entropy requests to one random peer; any connection carries the replies to what arrived on it.
A slow peer never blocks the others: each connection has a bounded queue and frames that do not fit
are dropped (anti-entropy repairs them). Frames are sealed with mesh/auth.py (HMAC with the cluster
secret); a connection that sends one bad MAC is closed.

The listener is reachable by anyone who can reach the port, so an inbound connection costs little
until it authenticates: its whole first frame must arrive within HELLO_TIMEOUT_S of the accept (one
deadline, not one per read: a byte every 1.9 s would otherwise hold a slot forever, and MAX_INBOUND such
connections would lock the real peers out) and be at most HELLO_MAX_BYTES (a dialer's first frame is a
state vector of a few bytes per replica); only then are frames up to the transport limit read. Inbound
connections are capped, and one silent for IDLE_TIMEOUT_S is closed (its dialer reconnects).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

import trio

from mesh.auth import MAX_PACKET_BYTES, AuthError, FrameError, FrameReader, MeshAuth, frame
from mesh.sync_protocol import SyncProtocol

DOMAIN = "replication"
FRAME_KIND = 1
QUEUE_FRAMES = 256
CONNECT_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 1.0
LOAD_INTERVAL_S = 0.1
"""How often in-flight counts are checked for a change worth reporting to peers."""
LOAD_REFRESH_S = 0.5
"""An unchanged report is repeated this often, well inside mesh/peer_load.MAX_AGE_S."""
HELLO_TIMEOUT_S = 2.0
HELLO_MAX_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 60.0
MAX_INBOUND = 256
HEARD_FORGET_S = 300.0
"""A peer not heard from for this long is dropped from ``last_heard`` (ids are new at every start)."""

PeerAddresses = Callable[[], Mapping[str, tuple[str, int]]]
"""Live peers (replica id -> replication TCP address), e.g. from gossip membership."""


class _Connection:
    """One TCP stream with a bounded send queue drained by its own writer task."""

    def __init__(self, stream: trio.SocketStream, peer_id: str | None) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self._send, self._queue = trio.open_memory_channel[bytes](QUEUE_FRAMES)

    def send(self, packet: bytes) -> bool:
        try:
            self._send.send_nowait(packet)
        except trio.WouldBlock:
            return False
        return True

    async def write_loop(self) -> None:
        async for packet in self._queue:
            await self.stream.send_all(frame(packet))


class SyncService:
    """Runs one replica's replication: listener, dialers, batched broadcast, anti-entropy, compaction.

    ``last_heard`` maps each peer to the trio time of its last accepted frame (a lag estimate for admin).
    """

    def __init__(
        self,
        protocol: SyncProtocol,
        secret: bytes,
        peers: PeerAddresses,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        flush_interval: float = 0.03,
        anti_entropy_interval: float = 1.0,
        load_source: Callable[[], dict[str, int] | None] | None = None,
        load_interval: float = LOAD_INTERVAL_S,
        is_compactor: Callable[[], bool] | None = None,
        drop: Callable[[str], bool] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.protocol = protocol
        self.replica_id = protocol.doc.replica_id
        self.auth = MeshAuth(secret, self.replica_id, domain=DOMAIN, require_recipient=True)
        self.counters: Counter[str] = Counter()
        self.port: int | None = None
        self.last_heard: dict[str, float] = {}
        self._peers = peers
        self._host, self._port = host, port
        self._flush_interval = flush_interval
        self._anti_entropy_interval = anti_entropy_interval
        self._load_source = load_source
        self._load_interval = load_interval
        self._is_compactor = is_compactor or self._lowest_id_compacts
        self._drop = drop or (lambda _peer: False)
        self._wall_clock = wall_clock
        self._outbound: dict[str, _Connection] = {}
        self._dialers: dict[tuple[str, tuple[str, int]], trio.CancelScope] = {}
        self._inbound = 0

    def _lowest_id_compacts(self) -> bool:
        return self.replica_id == min([self.replica_id, *self._peers()])

    def connected_peers(self) -> list[str]:
        return sorted(self._outbound)

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started`` reports the bound port."""
        listeners = await trio.open_tcp_listeners(self._port, host=self._host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._serve_inbound, listeners)
            nursery.start_soon(self._dial_loop, nursery)
            nursery.start_soon(self._flush_loop)
            nursery.start_soon(self._anti_entropy_loop)
            if self._load_source is not None:
                nursery.start_soon(self._load_loop, self._load_source)
            task_status.started(self.port)

    def _sealed(self, packet: bytes, recipient: str | None) -> bytes | None:
        """The packet sealed for ``recipient`` (a copy replayed to another replica fails there), or None
        (counted) when a receiver would refuse its size."""
        sealed = self.auth.seal(FRAME_KIND, packet, self._wall_clock(), recipient=recipient)
        if len(sealed) > MAX_PACKET_BYTES:
            self.counters["dropped_oversized"] += 1
            return None
        return sealed

    def _broadcast(self, packet: bytes) -> None:
        self.send_to_all(packet)

    def send_to_all(self, packet: bytes) -> set[str]:
        """Queue ``packet`` on every outbound connection; returns the peers it was queued for."""
        queued = set()
        for peer_id, conn in self._outbound.items():
            if self._drop(peer_id):
                self.counters["dropped_by_filter"] += 1
                continue
            sealed = self._sealed(packet, peer_id)
            if sealed is None:
                return queued
            if conn.send(sealed):
                queued.add(peer_id)
            else:
                self.counters["dropped_queue_full"] += 1
        return queued

    def _reply(self, conn: _Connection, packet: bytes) -> None:
        if conn.peer_id is not None and self._drop(conn.peer_id):
            self.counters["dropped_by_filter"] += 1
            return
        sealed = self._sealed(packet, conn.peer_id)
        if sealed is not None and not conn.send(sealed):
            self.counters["dropped_queue_full"] += 1

    def _heard(self, peer: str) -> None:
        now = trio.current_time()
        if peer not in self.last_heard:
            for stale in [p for p, t in self.last_heard.items() if now - t > HEARD_FORGET_S]:
                del self.last_heard[stale]
        self.last_heard[peer] = now

    async def _flush_loop(self) -> None:
        while True:
            await trio.sleep(self._flush_interval)
            packet = self.protocol.update_frame()
            if packet is not None:
                self._broadcast(packet)

    async def _load_loop(self, source: Callable[[], dict[str, int] | None]) -> None:
        """Report this replica's in-flight requests per engine when they change, and at least every
        LOAD_REFRESH_S so peers know the report is current (nothing while ``source`` answers None)."""
        last: dict[str, int] | None = None
        sent_at = -math.inf
        while True:
            await trio.sleep(self._load_interval)
            loads = source()
            now = trio.current_time()
            if loads is not None and (loads != last or now - sent_at >= LOAD_REFRESH_S):
                self._broadcast(self.protocol.load_frame(loads))
                last, sent_at = loads, now

    async def _anti_entropy_loop(self) -> None:
        while True:
            await trio.sleep(self._anti_entropy_interval * random.uniform(0.75, 1.25))
            epoch_packet = self.protocol.maybe_compact(self._is_compactor())
            if epoch_packet is not None:
                self._broadcast(epoch_packet)
            if self._outbound:
                conn = self._outbound[random.choice(list(self._outbound))]
                self._reply(conn, self.protocol.state_frame())

    async def _dial_loop(self, nursery: trio.Nursery) -> None:
        """Keep one dialer per live peer; cancel dialers of peers that left or moved."""
        while True:
            wanted = {(pid, tuple(addr)) for pid, addr in self._peers().items() if pid != self.replica_id}
            for key in set(self._dialers) - wanted:
                self._dialers.pop(key).cancel()
            for key in wanted - set(self._dialers):
                self._dialers[key] = await nursery.start(self._dial, *key)
            await trio.sleep(self._flush_interval)

    async def _dial(
        self, peer_id: str, address: tuple[str, int], *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            backoff = 0.05
            while True:
                try:
                    with trio.fail_after(CONNECT_TIMEOUT_S):
                        stream = await trio.open_tcp_stream(*address)
                except (OSError, trio.TooSlowError):
                    self.counters["connect_failed"] += 1
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                backoff = 0.05
                conn = _Connection(stream, peer_id)
                self._outbound[peer_id] = conn
                self._reply(conn, self.protocol.state_frame())
                try:
                    await self._run_connection(conn)
                finally:
                    if self._outbound.get(peer_id) is conn:
                        del self._outbound[peer_id]
                await trio.sleep(backoff)

    async def _serve_inbound(self, stream: trio.SocketStream) -> None:
        if self._inbound >= MAX_INBOUND:
            self.counters["refused_inbound_cap"] += 1
            await stream.aclose()
            return
        self._inbound += 1
        try:
            await self._run_connection(_Connection(stream, None), inbound=True)
        finally:
            self._inbound -= 1

    async def _run_connection(self, conn: _Connection, inbound: bool = False) -> None:
        """Read and answer frames until the peer closes, errs, stays silent, or fails authentication."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.write_loop)
                await self._read_loop(conn, inbound)
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError, FrameError, AuthError,
                 trio.TooSlowError) as group:
            for exc in group.exceptions:
                self.counters[f"closed_{type(exc).__name__}"] += 1
        finally:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()

    async def _read_loop(self, conn: _Connection, inbound: bool) -> None:
        reader = FrameReader(MAX_PACKET_BYTES, first_frame_max=HELLO_MAX_BYTES if inbound else None)
        authenticated = not inbound
        hello_deadline = trio.current_time() + HELLO_TIMEOUT_S
        while True:
            deadline = trio.current_time() + IDLE_TIMEOUT_S if authenticated else hello_deadline
            with trio.fail_at(deadline):
                data = await conn.stream.receive_some(65536)
            if not data:
                return
            for packet in reader.feed(data):
                envelope = self.auth.open(packet, self._wall_clock())
                authenticated = True
                conn.peer_id = conn.peer_id or envelope.sender_id
                if self._drop(envelope.sender_id):
                    self.counters["dropped_by_filter"] += 1
                    continue
                self._heard(envelope.sender_id)
                if not isinstance(envelope.payload, bytes):
                    self.counters["malformed"] += 1
                    continue
                for reply in self.protocol.on_frame(envelope.payload, trio.current_time()):
                    self._reply(conn, reply)
