"""SWIM membership as a sans-IO state machine (time is an argument, messages are plain data).

The trio edge (:mod:`mesh.gossip`) feeds it authenticated messages and clock ticks, then sends what
:meth:`Swim.take_outgoing` returns and publishes what :meth:`Swim.take_events` returns. Everything else
(probing, indirect probes, suspicion, incarnations, piggybacked dissemination, full-state sync for
joins and partition healing, graceful leave) lives here, so it can be simulated deterministically.

Precedence of updates about one member (SWIM paper, as memberlist implements it):
``left`` is final; ``dead(i)`` beats alive/suspect with incarnation <= i; ``suspect(i)`` beats
``alive(i)``; anything with a strictly higher incarnation beats dead/suspect/alive. A member that hears
it is suspected or dead refutes with a higher incarnation.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_INCARNATION = 2**62
MAX_UPDATES_PER_MESSAGE = 4096
MAX_FIELD_CHARS = 512


class Kind(enum.IntEnum):
    """Gossip message kinds; they are the authenticated kind byte of :mod:`mesh.auth` (1..15)."""

    PING = 1
    ACK = 2
    PING_REQ = 3
    SYNC = 4
    SYNC_REPLY = 5
    NOTICE = 6


class State(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


LIVE_STATES = (State.ALIVE, State.SUSPECT)


class MalformedMessage(Exception):
    """An authenticated message did not have the expected shape; the edge counts and drops it."""


@dataclass(frozen=True, slots=True)
class Member:
    """A router replica as peers see it; ``id`` is unique per process start."""

    id: str
    gossip_addr: str
    replication_addr: str = ""
    http_addr: str = ""
    island: str = ""


@dataclass(slots=True)
class Record:
    member: Member
    incarnation: int
    state: State
    since: float


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """A change in this replica's view. ``kind`` is joined, alive, suspect, dead or left."""

    kind: str
    member: Member
    incarnation: int
    previous: State | None
    at: float


@dataclass(frozen=True, slots=True)
class Outgoing:
    addr: str
    kind: Kind
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SwimConfig:
    """Timings tuned for loopback/LAN: a dead replica is declared dead by all within about 2 s."""

    protocol_period: float = 0.2
    ping_timeout: float = 0.08
    indirect_probes: int = 3
    suspicion_timeout: float = 1.0
    retransmit_mult: int = 3
    max_piggyback: int = 8
    sync_interval: float = 2.0
    alone_sync_interval: float = 0.5
    dead_retention: float = 60.0


@dataclass(slots=True)
class _Probe:
    target_id: str
    seq: int
    sent_at: float
    indirect_sent: bool = False
    acked: bool = False


@dataclass(slots=True)
class _Relay:
    origin_addr: str
    origin_seq: int
    target_id: str
    expires: float


@dataclass(slots=True)
class _Broadcast:
    record: list[Any]
    transmits: int = 0


def _encode(record: Record) -> list[Any]:
    m = record.member
    return [
        m.id,
        m.gossip_addr,
        m.replication_addr,
        m.http_addr,
        m.island,
        record.incarnation,
        int(record.state),
    ]


def _decode(raw: Any) -> tuple[Member, int, State]:
    if not (isinstance(raw, list) and len(raw) == 7):
        raise MalformedMessage("member record must be a list of 7")
    *texts, incarnation, state = raw
    if not all(isinstance(t, str) and len(t) <= MAX_FIELD_CHARS for t in texts) or not texts[0]:
        raise MalformedMessage("member record fields must be short strings")
    if not (type(incarnation) is int and 0 <= incarnation < MAX_INCARNATION):
        raise MalformedMessage("bad incarnation")
    if not (type(state) is int and state in State._value2member_map_):
        raise MalformedMessage("bad state")
    return Member(*texts), incarnation, State(state)


def _field(payload: dict[str, Any], key: str, kind: type) -> Any:
    value = payload.get(key)
    if type(value) is not kind:
        raise MalformedMessage(f"field {key!r} must be {kind.__name__}")
    return value


class Swim:
    """One replica's membership view and failure detector."""

    def __init__(self, me: Member, config: SwimConfig, rng: random.Random, now: float) -> None:
        self.config = config
        self._rng = rng
        self._me = me
        self._incarnation = 0
        self._left = False
        self._records: dict[str, Record] = {}
        self._seeds: set[str] = set()
        self._broadcasts: dict[str, _Broadcast] = {}
        self._outgoing: list[Outgoing] = []
        self._events: list[MemberEvent] = []
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self._next_probe_at = now
        self._next_sync_at = now
        self.refutations = 0

    # ----- queries -------------------------------------------------------------------------------

    @property
    def me(self) -> Member:
        return self._me

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def live_members(self) -> list[Member]:
        """Self plus every member currently alive or suspect (suspects still serve until declared dead)."""
        others = [r.member for r in self._records.values() if r.state in LIVE_STATES]
        return sorted([self._me, *others] if not self._left else others, key=lambda m: m.id)

    def records(self) -> dict[str, Record]:
        """A snapshot of every known peer (including dead and left ones still retained)."""
        return {k: Record(r.member, r.incarnation, r.state, r.since) for k, r in self._records.items()}

    def state_of(self, member_id: str) -> State | None:
        record = self._records.get(member_id)
        return record.state if record else None

    def take_outgoing(self) -> list[Outgoing]:
        out, self._outgoing = self._outgoing, []
        return out

    def take_events(self) -> list[MemberEvent]:
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float:
        """When :meth:`tick` must next be called (earlier calls are harmless)."""
        deadlines = [self._next_probe_at, self._next_sync_at]
        if self._probe and not self._probe.indirect_sent and not self._probe.acked:
            deadlines.append(self._probe.sent_at + self.config.ping_timeout)
        deadlines += [
            r.since + self.config.suspicion_timeout
            for r in self._records.values()
            if r.state == State.SUSPECT
        ]
        return min(deadlines)

    # ----- inputs --------------------------------------------------------------------------------

    def set_seeds(self, addrs: Iterable[str]) -> None:
        """Replace the addresses contacted when joining and whenever they are not known live members."""
        self._seeds = {a for a in addrs if a and a != self._me.gossip_addr}

    def tick(self, now: float) -> None:
        """Advance timers: probes, indirect probes, suspicion expiry, syncs and record retention."""
        if self._left:
            return
        cfg = self.config
        probe = self._probe
        if probe and not probe.acked and not probe.indirect_sent and now >= probe.sent_at + cfg.ping_timeout:
            self._send_ping_reqs(probe, now)
        if now >= self._next_probe_at:
            starved = now > self._next_probe_at + cfg.protocol_period
            if probe and not probe.acked and not starved:
                self._suspect(probe.target_id, now)
            self._start_probe(now)
            self._next_probe_at = now + cfg.protocol_period
        for record in list(self._records.values()):
            if record.state == State.SUSPECT and now >= record.since + cfg.suspicion_timeout:
                self._set(record.member, record.incarnation, State.DEAD, now)
            elif record.state in (State.DEAD, State.LEFT) and now >= record.since + cfg.dead_retention:
                del self._records[record.member.id]
                self._broadcasts.pop(record.member.id, None)
        self._relays = {s: r for s, r in self._relays.items() if r.expires > now}
        if now >= self._next_sync_at:
            self._sync(now)

    def receive(self, kind: int, payload: Any, sender_id: str, now: float) -> None:
        """Handle one authenticated message; raises :class:`MalformedMessage` without changing state."""
        if kind not in Kind._value2member_map_ or not isinstance(payload, dict):
            raise MalformedMessage("unknown kind or non-map payload")
        sender, sender_inc, sender_state = _decode(payload.get("from"))
        if sender.id != sender_id:
            raise MalformedMessage("sender record does not match the authenticated sender")
        raw_updates = payload.get("u", [])
        if not isinstance(raw_updates, list) or len(raw_updates) > MAX_UPDATES_PER_MESSAGE:
            raise MalformedMessage("updates must be a bounded list")
        updates = [_decode(u) for u in raw_updates]
        kind = Kind(kind)
        fields = self._kind_fields(kind, payload)
        if sender.id == self._me.id or self._left:
            return
        self._apply(sender, sender_inc, sender_state, now)
        for member, incarnation, state in updates:
            self._apply(member, incarnation, state, now)
        self._dispatch(kind, fields, sender, now)

    def leave(self, now: float) -> None:
        """Tell every live peer at once that this replica is leaving, then go quiet."""
        if self._left:
            return
        notice = self._message(State.LEFT, {})
        for record in self._records.values():
            if record.state in LIVE_STATES:
                self._outgoing.append(Outgoing(record.member.gossip_addr, Kind.NOTICE, dict(notice)))
        self._left = True

    # ----- message handling ----------------------------------------------------------------------

    @staticmethod
    def _kind_fields(kind: Kind, payload: dict[str, Any]) -> dict[str, Any]:
        if kind == Kind.PING:
            target = payload.get("target")
            if target is not None and type(target) is not str:
                raise MalformedMessage("ping target must be a member id or nil")
            return {"seq": _field(payload, "seq", int), "target": target}
        if kind == Kind.ACK:
            return {"seq": _field(payload, "seq", int), "target": _field(payload, "target", str)}
        if kind == Kind.PING_REQ:
            return {
                "seq": _field(payload, "seq", int),
                "target": _field(payload, "target", str),
                "addr": _field(payload, "addr", str),
            }
        return {}

    def _dispatch(self, kind: Kind, fields: dict[str, Any], sender: Member, now: float) -> None:
        if kind == Kind.PING:
            self._send(sender.gossip_addr, Kind.ACK, {"seq": fields["seq"], "target": self._me.id})
        elif kind == Kind.ACK:
            self._on_ack(fields["seq"], fields["target"], sender)
        elif kind == Kind.PING_REQ:
            seq = self._next_seq()
            self._relays[seq] = _Relay(
                sender.gossip_addr, fields["seq"], fields["target"], now + self.config.protocol_period
            )
            self._send(fields["addr"], Kind.PING, {"seq": seq, "target": fields["target"]})
        elif kind == Kind.SYNC:
            self._send_full_state(sender.gossip_addr, Kind.SYNC_REPLY)

    def _on_ack(self, seq: int, target: str, sender: Member) -> None:
        probe = self._probe
        if probe and probe.seq == seq and probe.target_id == target:
            probe.acked = True
            return
        relay = self._relays.pop(seq, None)
        if relay and relay.target_id == target == sender.id:
            self._send(relay.origin_addr, Kind.ACK, {"seq": relay.origin_seq, "target": target})

    # ----- state changes -------------------------------------------------------------------------

    def _apply(self, member: Member, incarnation: int, state: State, now: float) -> None:
        if member.id == self._me.id:
            if state != State.ALIVE and incarnation >= self._incarnation:
                self._incarnation = incarnation + 1
                self.refutations += 1
                self._queue_broadcast(self._encode_self(State.ALIVE))
            return
        current = self._records.get(member.id)
        if current is None:
            accepted = True
        elif current.state == State.LEFT:
            accepted = False
        elif state == State.LEFT:
            accepted = True
        elif state == State.DEAD:
            accepted = current.state != State.DEAD and incarnation >= current.incarnation
        elif state == State.SUSPECT:
            accepted = incarnation > current.incarnation or (
                incarnation == current.incarnation and current.state == State.ALIVE
            )
        else:
            accepted = incarnation > current.incarnation
        if accepted:
            self._set(member, incarnation, state, now)

    def _set(self, member: Member, incarnation: int, state: State, now: float) -> None:
        previous = self._records.get(member.id)
        record = Record(member, incarnation, state, now)
        if previous and previous.state == state:
            record.since = previous.since if state == State.ALIVE else now
        self._records[member.id] = record
        self._queue_broadcast(_encode(record))
        if previous is None or previous.state != state:
            kind = "joined" if previous is None and state in LIVE_STATES else state.name.lower()
            self._events.append(MemberEvent(kind, member, incarnation, previous and previous.state, now))

    def _suspect(self, member_id: str, now: float) -> None:
        record = self._records.get(member_id)
        if record and record.state == State.ALIVE:
            self._set(record.member, record.incarnation, State.SUSPECT, now)

    # ----- probing -------------------------------------------------------------------------------

    def _live_peer_ids(self, states: tuple[State, ...] = LIVE_STATES) -> list[str]:
        return [k for k, r in self._records.items() if r.state in states]

    def _start_probe(self, now: float) -> None:
        self._probe = None
        while True:
            if not self._probe_order:
                self._probe_order = self._live_peer_ids()
                self._rng.shuffle(self._probe_order)
                if not self._probe_order:
                    return
            target = self._records.get(self._probe_order.pop())
            if target and target.state in LIVE_STATES:
                break
        self._probe = _Probe(target.member.id, self._next_seq(), now)
        self._send(target.member.gossip_addr, Kind.PING, {"seq": self._probe.seq, "target": target.member.id})

    def _send_ping_reqs(self, probe: _Probe, now: float) -> None:
        probe.indirect_sent = True
        target = self._records.get(probe.target_id)
        if target is None:
            return
        helpers = [k for k in self._live_peer_ids((State.ALIVE,)) if k != probe.target_id]
        for helper in self._rng.sample(helpers, min(self.config.indirect_probes, len(helpers))):
            self._send(
                self._records[helper].member.gossip_addr,
                Kind.PING_REQ,
                {"seq": probe.seq, "target": probe.target_id, "addr": target.member.gossip_addr},
            )

    def _sync(self, now: float) -> None:
        """Full-state exchange: joins through seeds, re-contacts dead peers so healed partitions merge."""
        live_addrs = {r.member.gossip_addr for r in self._records.values() if r.state in LIVE_STATES}
        targets = self._seeds - live_addrs
        dead = [r.member.gossip_addr for r in self._records.values() if r.state == State.DEAD]
        live = [r.member.gossip_addr for r in self._records.values() if r.state == State.ALIVE]
        for pool in (dead, live):
            if pool:
                targets.add(self._rng.choice(pool))
        for addr in sorted(targets - {self._me.gossip_addr}):
            self._send_full_state(addr, Kind.SYNC)
        alone = not live_addrs
        self._next_sync_at = now + (self.config.alone_sync_interval if alone else self.config.sync_interval)

    # ----- encoding and dissemination ------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % MAX_INCARNATION
        return self._seq

    def _encode_self(self, state: State) -> list[Any]:
        return _encode(Record(self._me, self._incarnation, state, 0.0))

    def _message(self, self_state: State, fields: dict[str, Any]) -> dict[str, Any]:
        return {"from": self._encode_self(self_state), **fields}

    def _queue_broadcast(self, record: list[Any]) -> None:
        self._broadcasts[record[0]] = _Broadcast(record)

    def _retransmit_limit(self) -> int:
        n = len(self._live_peer_ids()) + 1
        return self.config.retransmit_mult * max(1, math.ceil(math.log2(n + 1)))

    def _piggyback(self, addr: str) -> list[list[Any]]:
        """Least-sent updates first, plus our view of the destination if it is suspect or dead."""
        updates: list[list[Any]] = []
        for record in self._records.values():
            if record.member.gossip_addr == addr and record.state in (State.SUSPECT, State.DEAD):
                updates.append(_encode(record))
        chosen = sorted(self._broadcasts.items(), key=lambda kv: kv[1].transmits)[: self.config.max_piggyback]
        limit = self._retransmit_limit()
        for member_id, broadcast in chosen:
            updates.append(broadcast.record)
            broadcast.transmits += 1
            if broadcast.transmits >= limit:
                del self._broadcasts[member_id]
        return updates

    def _send(self, addr: str, kind: Kind, fields: dict[str, Any]) -> None:
        payload = self._message(State.ALIVE, fields)
        payload["u"] = self._piggyback(addr)
        self._outgoing.append(Outgoing(addr, kind, payload))

    def _send_full_state(self, addr: str, kind: Kind) -> None:
        payload = self._message(State.ALIVE, {})
        payload["u"] = [_encode(r) for r in self._records.values()]
        self._outgoing.append(Outgoing(addr, kind, payload))
