"""SWIM state machines on a simulated lossy network with a deterministic clock."""

from __future__ import annotations

import heapq
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.swim import Kind, MalformedMessage, Member, State, Swim, SwimConfig

CONFIG = SwimConfig()
STEP = 0.01
sim_settings = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class SimNet:
    """N Swim machines; messages go through msgpack and arrive 1-10 ms later unless lost."""

    def __init__(self, n: int, seed: int, loss: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.loss = loss
        self.now = 0.0
        self.nodes: dict[str, Swim] = {}
        for i in range(n):
            me = Member(f"n{i}", f"10.0.0.{i}:7946", f"10.0.0.{i}:9000", f"10.0.0.{i}:8000", "a")
            swim = Swim(me, CONFIG, random.Random(seed * 1000 + i), now=0.0)
            swim.set_seeds(["10.0.0.0:7946"])
            self.nodes[me.id] = swim
        self.killed: set[str] = set()
        self.paused_until: dict[str, float] = {}
        self.events: list[tuple[str, float, str, str]] = []
        self._queue: list[tuple[float, int, str, int, bytes, str]] = []
        self._counter = 0
        self._by_addr = {s.me.gossip_addr: k for k, s in self.nodes.items()}

    def running(self, node: str) -> bool:
        return node not in self.killed and self.paused_until.get(node, 0.0) <= self.now

    def run_until(self, t: float) -> None:
        while self.now < t - 1e-9:
            self.now += STEP
            self._deliver()
            for name, swim in self.nodes.items():
                if self.running(name):
                    swim.tick(self.now)
                    self._flush(name)

    def _deliver(self) -> None:
        while self._queue and self._queue[0][0] <= self.now:
            _, _, dst, kind, blob, sender = heapq.heappop(self._queue)
            if dst in self.killed:
                continue
            if not self.running(dst):
                self._push(self.paused_until[dst], dst, kind, blob, sender)
                continue
            self.nodes[dst].receive(kind, msgpack.unpackb(blob), sender, self.now)
            self._flush(dst)

    def _push(self, at: float, dst: str, kind: int, blob: bytes, sender: str) -> None:
        self._counter += 1
        heapq.heappush(self._queue, (at, self._counter, dst, kind, blob, sender))

    def _flush(self, name: str) -> None:
        swim = self.nodes[name]
        for event in swim.take_events():
            self.events.append((name, event.at, event.kind, event.member.id))
        for out in swim.take_outgoing():
            dst = self._by_addr.get(out.addr)
            if dst is None or self.rng.random() < self.loss:
                continue
            self._push(
                self.now + self.rng.uniform(0.001, 0.01), dst, out.kind, msgpack.packb(out.payload), name
            )

    def view(self, name: str) -> dict[str, State]:
        return {k: r.state for k, r in self.nodes[name].records().items()}


@sim_settings
@given(st.integers(2, 6), st.floats(0.0, 0.1), st.integers(0, 2**32))
def test_all_members_converge_to_the_same_view_despite_loss(n, loss, seed):
    net = SimNet(n, seed, loss)
    net.run_until(6.0)
    net.loss = 0.0
    net.run_until(16.0)
    everyone = set(net.nodes)
    for name in net.nodes:
        assert {m.id for m in net.nodes[name].live_members()} == everyone
        assert set(net.view(name).values()) == {State.ALIVE}


@sim_settings
@given(st.integers(3, 6), st.floats(0.0, 0.05), st.integers(0, 2**32), st.data())
def test_killed_member_is_declared_dead_by_every_survivor_within_3s(n, loss, seed, data):
    net = SimNet(n, seed, loss)
    net.run_until(3.0)
    victim = data.draw(st.sampled_from(sorted(net.nodes)))
    killed_at = net.now
    net.killed.add(victim)
    net.run_until(killed_at + 3.0)
    survivors = set(net.nodes) - {victim}
    for name in survivors:
        assert net.view(name)[victim] == State.DEAD
        deaths = [t for who, t, kind, m in net.events if who == name and kind == "dead" and m == victim]
        assert deaths and deaths[0] - killed_at <= 3.0
        assert victim not in {m.id for m in net.nodes[name].live_members()}


@sim_settings
@given(st.integers(3, 5), st.floats(0.3, 4.0), st.integers(0, 2**32), st.data())
def test_paused_member_is_suspected_then_refutes_and_is_alive_everywhere(n, pause, seed, data):
    net = SimNet(n, seed)
    net.run_until(3.0)
    sleeper = data.draw(st.sampled_from(sorted(net.nodes)))
    net.paused_until[sleeper] = net.now + pause
    net.run_until(net.now + pause + 10.0)
    suspected = [e for e in net.events if e[3] == sleeper and e[2] in ("suspect", "dead")]
    if pause >= 2.0:
        assert suspected
    for name, swim in net.nodes.items():
        if name != sleeper:
            assert net.view(name)[sleeper] == State.ALIVE
            assert swim.records()[sleeper].incarnation == net.nodes[sleeper].incarnation
    assert (net.nodes[sleeper].incarnation > 0) == bool(suspected)


def _pair() -> tuple[Swim, Swim]:
    a = Swim(Member("a", "h:1"), CONFIG, random.Random(1), now=0.0)
    b = Swim(Member("b", "h:2"), CONFIG, random.Random(2), now=0.0)
    return a, b


def _deliver_all(src: Swim, dst: Swim, now: float) -> None:
    for out in src.take_outgoing():
        if out.addr == dst.me.gossip_addr:
            dst.receive(out.kind, msgpack.unpackb(msgpack.packb(out.payload)), src.me.id, now)


def test_suspicion_about_self_is_refuted_with_higher_incarnation():
    a, b = _pair()
    a.set_seeds(["h:2"])
    a.tick(0.0)
    _deliver_all(a, b, 0.0)
    rumour = {"from": ["a", "h:1", "", "", "", 0, 0], "u": [["b", "h:2", "", "", "", 0, int(State.SUSPECT)]]}
    b.receive(Kind.NOTICE, rumour, "a", 0.1)
    assert b.incarnation == 1 and b.refutations == 1
    b.tick(0.2)
    a.take_outgoing()
    _deliver_all(b, a, 0.2)
    assert a.records()["b"].incarnation == 1 and a.state_of("b") == State.ALIVE


def test_leave_removes_member_at_once():
    a, b = _pair()
    a.set_seeds(["h:2"])
    a.tick(0.0)
    _deliver_all(a, b, 0.0)
    _deliver_all(b, a, 0.0)
    b.take_events()
    a.leave(0.5)
    _deliver_all(a, b, 0.5)
    assert b.state_of("a") == State.LEFT
    assert [e.kind for e in b.take_events()] == ["left"]
    assert [m.id for m in b.live_members()] == ["b"]


def test_left_is_final_even_against_higher_incarnation():
    _, b = _pair()
    b.receive(Kind.NOTICE, {"from": ["a", "h:1", "", "", "", 3, int(State.LEFT)]}, "a", 0.0)
    b.receive(Kind.NOTICE, {"from": ["a", "h:1", "", "", "", 9, 0]}, "a", 0.1)
    assert b.state_of("a") == State.LEFT


def test_sender_must_match_authenticated_identity():
    _, b = _pair()
    with pytest.raises(MalformedMessage):
        b.receive(Kind.PING, {"from": ["x", "h:9", "", "", "", 0, 0], "seq": 1}, "a", 0.0)
    assert b.records() == {} and b.take_outgoing() == []


record = st.lists(st.one_of(st.text(max_size=5), st.integers(-2, 2**63), st.none()), max_size=8)
payloads = st.one_of(
    st.dictionaries(
        st.sampled_from(["from", "u", "seq", "target", "addr", "x"]),
        st.one_of(record, st.lists(record, max_size=3), st.integers(), st.text(max_size=5), st.none()),
    ),
    st.integers(),
    st.none(),
)


@settings(max_examples=300)
@given(st.integers(0, 10), payloads)
def test_malformed_messages_raise_malformed_or_apply_cleanly(kind, payload):
    _, b = _pair()
    try:
        b.receive(kind, payload, "a", 0.0)
    except MalformedMessage:
        assert b.records() == {}
    b.tick(1.0)
