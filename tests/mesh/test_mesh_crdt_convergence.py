"""Property tests: in-memory replicas with a lossy, reordering, duplicating network converge.

Each engine has one writer (replica i owns the engines whose number is i modulo the replica count), as
in production. After any sequence of writes, deliveries, drops, duplications and compactions by the
designated compactor, a healing phase (lossless delivery plus anti-entropy) must leave every replica
with the same document view and a mirror equal to a brute-force reference of the owners' last ops.
"""

from __future__ import annotations

from doc_replica import Replica
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Doc, Map

from mesh.sync_protocol import SyncProtocol

ENGINES = [f"e{i}" for i in range(6)]
HASHES = st.integers(min_value=0, max_value=40).map(lambda h: h * 0x9E3779B97F4A7C15 % 2**60)


class Cluster:
    """Replicas joined by an explicit in-flight message list that the test drives step by step."""

    def __init__(self, size: int) -> None:
        self.replicas = [Replica(f"r{i}") for i in range(size)]
        self.protocols = [SyncProtocol(r.doc, epoch_resend_s=0.0) for r in self.replicas]
        self.in_flight: list[tuple[int, int, bytes]] = []
        self.reference: dict[str, dict[int, int]] = {e: {} for e in ENGINES}
        self.now = 0.0

    def owner(self, engine: str) -> int:
        return int(engine[1:]) % len(self.replicas)

    def flush(self, src: int) -> None:
        frame = self.protocols[src].update_frame()
        if frame is not None:
            self.in_flight.extend((src, dst, frame) for dst in range(len(self.replicas)) if dst != src)

    def anti_entropy(self, src: int, dst: int) -> None:
        if src != dst:
            self.in_flight.append((src, dst, self.protocols[src].state_frame()))

    def deliver(self, index: int) -> None:
        src, dst, frame = self.in_flight.pop(index)
        self.now += 0.01
        self.in_flight.extend((dst, src, reply) for reply in self.protocols[dst].on_frame(frame, self.now))

    def compact(self) -> None:
        frame = self.protocols[0].maybe_compact(True, min_churn=0, ratio=0.0)
        assert frame is not None
        self.in_flight.extend((0, dst, frame) for dst in range(1, len(self.replicas)))

    def heal(self) -> None:
        """Lossless rounds: flush everything, full anti-entropy, deliver until quiet."""
        n = len(self.replicas)
        for _ in range(4):
            for src in range(n):
                self.flush(src)
                for dst in range(n):
                    self.anti_entropy(src, dst)
            bound = 10_000
            while self.in_flight and bound:
                self.deliver(0)
                bound -= 1
            assert not self.in_flight


def write(cluster: Cluster, data: st.DataObject) -> None:
    engine = data.draw(st.sampled_from(ENGINES))
    replica = cluster.replicas[cluster.owner(engine)]
    ref = cluster.reference[engine]
    kind = data.draw(st.sampled_from(["store", "remove", "clear", "registry"]))
    if kind == "store":
        pairs = data.draw(st.lists(st.tuples(HASHES, HASHES), max_size=6))
        replica.store(engine, pairs)
        ref.update(pairs)
    elif kind == "remove":
        hashes = data.draw(st.lists(st.sampled_from(sorted(ref)) if ref else HASHES, max_size=4))
        replica.remove(engine, hashes)
        for h in hashes:
            ref.pop(h, None)
    elif kind == "clear":
        replica.remove(engine, list(replica.pairs(engine)))
        ref.clear()
    else:
        replica.set_registry(engine, {"drain": data.draw(st.booleans())})


def network(cluster: Cluster, data: st.DataObject) -> None:
    n = len(cluster.replicas)
    kind = data.draw(st.sampled_from(["flush", "deliver", "drop", "dup", "anti", "compact"]))
    if kind == "flush":
        cluster.flush(data.draw(st.integers(0, n - 1)))
    elif kind == "anti":
        cluster.anti_entropy(data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1)))
    elif kind == "compact":
        cluster.compact()
    elif cluster.in_flight:
        index = data.draw(st.integers(0, len(cluster.in_flight) - 1))
        if kind == "deliver":
            cluster.deliver(index)
        elif kind == "drop":
            cluster.in_flight.pop(index)
        else:
            cluster.in_flight.append(cluster.in_flight[index])


def assert_converged(cluster: Cluster) -> None:
    first = cluster.replicas[0]
    for replica in cluster.replicas:
        assert replica.doc.epoch == first.doc.epoch
        assert replica.doc.content == first.doc.content
        for engine in ENGINES:
            assert replica.pairs(engine) == cluster.reference[engine], (replica.doc.replica_id, engine)


@settings(max_examples=80, deadline=None)
@given(size=st.integers(2, 4), data=st.data())
def test_mesh_crdt_random_delivery_converges_to_reference(size: int, data: st.DataObject) -> None:
    cluster = Cluster(size)
    for _ in range(data.draw(st.integers(1, 60))):
        if data.draw(st.booleans()):
            write(cluster, data)
        else:
            network(cluster, data)
        for engine in ENGINES:
            owner = cluster.replicas[cluster.owner(engine)]
            assert owner.pairs(engine) == cluster.reference[engine], "an owner lost its own write"
    cluster.heal()
    assert_converged(cluster)


def test_a_delete_that_waited_for_its_writers_earlier_update_leaves_no_key_behind():
    """The case hypothesis found: a replica misses its writer's first update, takes a later store out of order,
    then the clear of that store; once anti-entropy brings the first update, the map holds nothing of the cleared
    engine and the replica's view must not either (the map's event for that delete names no key)."""
    cluster = Cluster(4)
    writer = cluster.replicas[1]
    writer.store("e1", [(0, 0)])
    cluster.reference["e1"][0] = 0
    cluster.flush(1)
    writer.store("e5", [(0, 0)])
    cluster.flush(1)
    cluster.in_flight.pop(1)  # replica 2 never gets the first update directly
    writer.remove("e5", list(writer.pairs("e5")))
    cluster.heal()
    assert cluster.replicas[2].pairs("e5") == {}
    assert_converged(cluster)


def test_a_clear_after_an_overwrite_of_an_adopted_key_leaves_no_key_behind():
    """The second case hypothesis found: two compactions, overwrites of a key the follower adopted, an update of the
    newest epoch delivered ahead of the rest, then the writer's clear. The map event for the clear names one of its
    two keys; the follower's view must still lose both."""
    cluster = Cluster(2)
    writer = cluster.replicas[0]
    big = 1024421277861575701

    def store(pairs: list[tuple[int, int]]) -> None:
        writer.store("e0", pairs)
        cluster.reference["e0"].update(pairs)

    store([(0, 0)])
    cluster.flush(0)
    cluster.compact()
    cluster.compact()
    store([(0, big), (big, 0)])
    cluster.flush(0)
    writer.set_registry("e0", {"drain": False})
    cluster.flush(0)
    store([(0, 0)])
    cluster.flush(0)
    cluster.deliver(4)  # the registry update of epoch 2 before both epoch frames
    writer.remove("e0", list(writer.pairs("e0")))
    cluster.reference["e0"].clear()
    cluster.heal()
    assert cluster.replicas[1].pairs("e0") == {}
    assert_converged(cluster)


def test_a_malformed_value_is_counted_once_and_kept_out_of_the_view():
    """A peer's value that is not a string stays out of the view and is counted when it arrives, not again at every
    later event (the view's size differs from the map's by exactly those keys)."""
    follower = Cluster(2).replicas[1]
    peer = Doc()
    pairs = peer.get("pairs", type=Map)
    pairs["e1\x1f1"] = 7
    follower.doc.apply_update(peer.get_update())
    pairs["e1\x1f2"] = "2"
    follower.doc.apply_update(peer.get_update())
    assert follower.pairs("e1") == {2: 2}
    assert follower.doc.malformed_values == 1
