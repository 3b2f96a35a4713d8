"""Three autoscaler loops on an in-process mesh (documents merged last-writer-wins within each side of a
partition): one actor at any time, however long a partition lasts, whoever stalls, and one provision."""

import json
from dataclasses import dataclass, field

import pytest
import trio
from test_autoscale_loop import FakeFleet, config

from autoscale.loop import AutoscaleLoop
from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProviderError, ProvisionedEngine
from gateway.engines import EngineRegistry

EPOCH = 1_000_000.0


class Cloud(Provider):
    """One provider shared by every replica, fenced like the example scripts: a term older than the newest
    seen is refused."""

    name = "cloud"

    def __init__(self) -> None:
        super().__init__()
        self.newest = -1
        self.provisions: list[int] = []
        self.refused: list[int] = []

    def fence(self, term: int) -> None:
        if term < self.newest:
            self.refused.append(term)
            raise ProviderError(f"stale lease term {term}")
        self.newest = term

    async def _provision(self, request_id, offer, term):
        self.fence(term)
        self.provisions.append(term)
        return ProvisionedEngine(f"e-{len(self.provisions)}", f"http://127.0.0.1:{9000 + len(self.provisions)}")

    async def terminate(self, engine_id, term):
        self.fence(term)

    async def list(self, term):
        self.fence(term)
        return []


@dataclass
class Net:
    """Each replica's copy of the ``autoscaler`` namespace: key -> (stamp, writer, value)."""

    ids: list[str]
    docs: dict[str, dict[str, tuple[float, str, str | None]]] = field(default_factory=dict)
    sides: list[set[str]] = field(default_factory=list)
    stalled: set[str] = field(default_factory=set)
    """Stalled replicas answer no probe: the others see them as suspect (not alive)."""
    clock: float = 0.0

    def __post_init__(self) -> None:
        self.docs = {i: {} for i in self.ids}
        self.heal()

    def heal(self) -> None:
        self.sides = [set(self.ids)]

    def cut(self, *side: str) -> None:
        self.sides = [set(side), set(self.ids) - set(side)]

    def side(self, member: str) -> set[str]:
        return next(s for s in self.sides if member in s)

    def sync(self, skip: set[str] = frozenset()) -> None:
        for side in self.sides:
            members = side - skip
            merged: dict[str, tuple[float, str, str | None]] = {}
            for member in members:
                for key, entry in self.docs[member].items():
                    if key not in merged or entry[:2] > merged[key][:2]:
                        merged[key] = entry
            for member in members:
                self.docs[member] = dict(merged)


class Node:
    def __init__(self, net: Net, member_id: str) -> None:
        self.net, self.member_id, self.isolated = net, member_id, False

    def live_members(self) -> list[str]:
        return sorted(self.net.side(self.member_id))

    def alive_members(self) -> set[str]:
        return (self.net.side(self.member_id) - self.net.stalled) | {self.member_id}

    def departed_members(self) -> set[str]:
        return set()


class State:
    """The part of gateway/mesh_state.py the autoscaler uses, on one replica's copy of the document."""

    def __init__(self, net: Net, member_id: str) -> None:
        self.net, self.node = net, Node(net, member_id)

    def _get(self, key: str) -> str | None:
        entry = self.net.docs[self.node.member_id].get(key)
        return entry[2] if entry else None

    def _put(self, key: str, text: str | None) -> None:
        self.net.docs[self.node.member_id][key] = (self.net.clock, self.node.member_id, text)

    def lease(self):
        return self._get("lease")

    def write_lease(self, text):
        self._put("lease", text)

    def members(self):
        return self._get("members")

    def write_members(self, members):
        self._put("members", json.dumps(members))

    def autoscaler_entries(self, prefix):
        return {k: json.loads(e[2]) for k, e in self.net.docs[self.node.member_id].items()
                if k.startswith(prefix) and e[2] is not None and k not in ("lease", "members")}

    def set_autoscaler_entry(self, key, value):
        self._put(key, None if value is None else json.dumps(value))


def mesh(ids: list[str]) -> tuple[Net, Cloud, list[AutoscaleLoop]]:
    net, cloud, registry = Net(ids), Cloud(), EngineRegistry()  # the engine registry replicates at once
    loops = []
    for member in ids:
        fleet = FakeFleet(registry)
        scaling = config(min_engines=1, max_engines=1, lease_ttl_s=3.0, interval_s=0.5, join_s=10.0)
        scaling.offers = [Offer("o", capacity=2, provisioning_s=0)]
        state = State(net, member)
        loop = AutoscaleLoop(scaling, fleet, fleet.signals, state, state.node.member_id, fleet.metrics.registry,
                             cloud)
        loop.keeper.started_at = EPOCH
        loops.append(loop)
    return net, cloud, loops


async def run_mesh(net, loops, nursery, until: float, stalled: set[str] = frozenset(), actors=None):
    """Every 0.25 s (simulated): documents sync, lease steps, and every 0.5 s a decision; records the actors."""
    net.stalled = set(stalled)
    while net.clock < until:
        await trio.sleep(0.25)
        net.clock = EPOCH + trio.current_time()
        net.sync(skip=net.stalled)
        for loop in loops:
            if loop.me in stalled:
                continue
            loop.lease_step(net.clock)
            if round(net.clock * 4) % 2 == 0:
                loop.tick(net.clock)
        acting = [loop.me for loop in loops if loop.may_act(net.clock)]
        assert len(acting) <= 1, (net.clock - EPOCH, acting)
        if actors is not None:
            actors.append((net.clock, acting[0] if acting else None))
    net.stalled = set()


@pytest.mark.parametrize("cut", ["a", "c"])
async def test_a_partition_longer_than_a_minute_never_makes_two_actors_nor_two_provisions(autojump_clock, cut):
    """One replica is cut off for 90 s, the holder (a) or another (c). A cut-off holder stops acting before
    its lease expires and the majority takes over once it has; the lone replica never regains a quorum
    (the old sliding minute made it its own majority after 60 s, and c then claimed beside a). After
    healing there is still one actor, and one provision in all."""
    net, cloud, loops = mesh(["a", "b", "c"])
    async with trio.open_nursery() as nursery:
        for loop in loops:
            loop._nursery = nursery
            cloud.attach(nursery)
        actors: list[tuple[float, str | None]] = []
        await run_mesh(net, loops, nursery, EPOCH + 20, actors=actors)
        assert actors[-1][1] == "a" and all(a in (None, "a") for _, a in actors)
        assert json.loads(loops[1].state.members()) == ["a", "b", "c"]
        assert len(cloud.provisions) == 1

        net.cut(cut)
        cut_at = net.clock
        await run_mesh(net, loops, nursery, cut_at + 90, actors=actors)
        during = [(t - cut_at, a) for t, a in actors if t > cut_at]
        assert all(a != cut for t, a in during if t > 3.0), "the cut-off replica acted"
        actor = "b" if cut == "a" else "a"
        assert {a for _, a in during[-300:]} == {actor}  # the majority's lowest, for the last 75 s
        if cut == "a":
            took_over = min(t for t, a in during if a == "b")
            assert 2.0 < took_over < 6.0, took_over  # not before the cut-off holder's lease expired

        net.heal()
        healed_at = net.clock
        await run_mesh(net, loops, nursery, healed_at + 30, actors=actors)
        assert {a for t, a in actors if t > healed_at + 5} == {actor}
        assert not cloud.refused and len(cloud.provisions) == 1 and len(loops[0].fleet.engines.all()) == 1
        nursery.cancel_scope.cancel()


async def test_a_holder_whose_loop_stalled_does_not_act_on_its_old_verdict(autojump_clock):
    """The holder's loop stalls for 10 s (no lease step, no document sync). Another replica takes the lease
    once it expired; when the stalled loop wakes, its next decision comes before its next lease step: it
    must not act, and a provider call it had under way is refused by the term."""
    net, cloud, loops = mesh(["a", "b", "c"])
    async with trio.open_nursery() as nursery:
        for loop in loops:
            loop._nursery = nursery
            cloud.attach(nursery)
        await run_mesh(net, loops, nursery, EPOCH + 20)
        holder = loops[0]
        assert holder.acting and holder.term == 1
        await run_mesh(net, loops, nursery, net.clock + 10, stalled={"a"})
        assert loops[1].may_act(net.clock) and loops[1].term == 2
        assert holder.acting  # its last verdict, from before the stall
        assert not holder.may_act(net.clock) and holder.tick(net.clock) is None
        net.sync()
        assert not holder.may_act(net.clock) and holder.tick(net.clock) is None
        # a provision the stalled holder had started with its old term is refused by the fenced provider
        with_old_term = holder.provider.provision(holder.core.offers[0], lambda result: None, holder.term)
        await trio.sleep(0.1)
        assert with_old_term.startswith("cloud-1-") and cloud.refused == [1] and len(cloud.provisions) == 1
        nursery.cancel_scope.cancel()
