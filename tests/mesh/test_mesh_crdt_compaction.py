"""Compaction epochs: no lost update across the switch, size shrinks, bad input is counted and dropped."""

from __future__ import annotations

import msgpack
from doc_replica import Replica
from hypothesis import given
from hypothesis import strategies as st

from mesh.crdt_doc import Epoch, decode_state, encode_state
from mesh.sync_protocol import SyncProtocol


def exchange(frames: list[bytes], receiver: SyncProtocol, sender: SyncProtocol, now: float = 0.0) -> None:
    """Deliver frames to receiver and ping-pong every reply until both sides are quiet."""
    pending = [(receiver, sender, f) for f in frames]
    while pending:
        dst, src, frame = pending.pop(0)
        pending.extend((src, dst, reply) for reply in dst.on_frame(frame, now))


def test_mesh_crdt_writes_racing_a_compaction_are_not_lost() -> None:
    a, b = Replica("a"), Replica("b")
    pa, pb = SyncProtocol(a.doc), SyncProtocol(b.doc)
    b.store("eb", [(h, h + 1) for h in range(100)])
    exchange([pb.update_frame()], pa, pb)
    b.remove("eb", range(50))  # not yet delivered when a compacts
    b.store("eb", [(h, h + 7) for h in range(200, 220)])
    unsent = pb.update_frame()
    a.store("ea", [(1, 2)])
    epoch_frame = pa.maybe_compact(True, min_churn=0, ratio=0.0)
    assert epoch_frame is not None and a.doc.epoch == Epoch(1, "a")
    assert a.block_count("eb") == 100  # the snapshot predates b's last ops
    exchange([unsent], pa, pb)  # old-epoch update: a answers with its epoch, b adopts and re-writes
    assert b.doc.epoch == Epoch(1, "a")
    b.store("eb", [(300, 301)])  # a write on the new epoch
    exchange([pb.update_frame()], pa, pb)
    expected = {h: h + 1 for h in range(50, 100)} | {h: h + 7 for h in range(200, 220)} | {300: 301}
    assert a.pairs("eb") == b.pairs("eb") == expected
    assert a.pairs("ea") == b.pairs("ea") == {1: 2}
    assert a.doc.content == b.doc.content


def test_mesh_crdt_compaction_shrinks_a_churned_document() -> None:
    index = Replica("a")
    protocol = SyncProtocol(index.doc)
    for round_ in range(20):
        index.store("e", [(round_ * 1000 + h, h) for h in range(500)])
        if round_:
            index.remove("e", [(round_ - 1) * 1000 + h for h in range(500)])
    before = index.doc.encoded_size()
    assert protocol.maybe_compact(True) is None  # below the default churn floor
    assert protocol.maybe_compact(True, min_churn=1000) is not None
    after = index.doc.encoded_size()
    assert index.block_count("e") == 500
    assert after < before / 3


def test_mesh_crdt_fresh_replica_adopts_newer_epoch_on_first_contact() -> None:
    a, c = Replica("a"), Replica("c")
    pa, pc = SyncProtocol(a.doc), SyncProtocol(c.doc)
    a.store("e", [(h, h) for h in range(10)])
    pa.maybe_compact(True, min_churn=0, ratio=0.0)
    c.store("other", [(5, 6)])
    exchange([pc.state_frame()], pa, pc)
    assert c.doc.epoch == a.doc.epoch
    exchange([pc.update_frame()], pa, pc)
    assert a.pairs("other") == c.pairs("other") == {5: 6}
    assert c.pairs("e") == {h: h for h in range(10)}


@given(st.dictionaries(st.integers(0, 2**53), st.integers(0, 2**32)))
def test_mesh_crdt_state_vector_codec_round_trips(state: dict[int, int]) -> None:
    assert decode_state(encode_state(state)) == state


def test_mesh_crdt_state_vector_matches_pycrdt() -> None:
    index = Replica("a")
    index.store("e", [(1, 2), (3, 4)])
    state = decode_state(index.doc.state())
    assert state == {index.doc.client_id: 2}
    assert encode_state(state) == index.doc.state()


@given(st.binary(max_size=64))
def test_mesh_crdt_garbage_frames_are_counted_and_dropped(data: bytes) -> None:
    index = Replica("a")
    protocol = SyncProtocol(index.doc)
    index.store("e", [(1, 2)])
    assert protocol.on_frame(data, 0.0) == []
    assert index.pairs("e") == {1: 2}


def test_mesh_crdt_well_formed_frames_with_bad_payloads_are_counted() -> None:
    index = Replica("a")
    protocol = SyncProtocol(index.doc)
    bad = [
        msgpack.packb(["u", 0, "", "x", b"\x01\x02garbage"]),
        msgpack.packb(["sv", 0, "", "x", b"\xff\xff"]),
        msgpack.packb(["zz", 0, "", "x"]),
        msgpack.packb(["ep", 5, "x", "x", b"\x00", b"not an update"]),
        msgpack.packb(["u", "0", "", "x", b""]),
        msgpack.packb({"u": 1}),
    ]
    for frame in bad:
        assert protocol.on_frame(frame, 0.0) == []
    assert protocol.counters["malformed"] + protocol.counters["malformed_snapshot"] == len(bad)
    assert index.doc.epoch == Epoch(0, "")


def test_mesh_crdt_compactions_never_bring_back_overwritten_values() -> None:
    """A writes K=v1, B overwrites it with v2, C compacts twice with A and B adopting each time: K stays v2
    everywhere, and the adopters' logs do not keep ops the adopted history already holds."""
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    pa, pb, pc = (SyncProtocol(r.doc) for r in (a, b, c))
    a.set_registry("engine", {"draining": True})
    exchange([pa.update_frame()], pb, pa)
    exchange([pa.state_frame()], pc, pa)
    b.set_registry("engine", {"draining": False})
    update = pb.update_frame()
    exchange([update], pa, pb)
    exchange([update], pc, pb)
    for epoch in (1, 2):
        frame = pc.maybe_compact(True, min_churn=0, ratio=0.0)
        exchange([frame], pa, pc)
        exchange([frame], pb, pc)
        assert a.doc.epoch == b.doc.epoch == c.doc.epoch == Epoch(epoch, "c")
        for p in (pa, pb, pc):
            frame = p.update_frame()
            if frame is not None:
                exchange([frame], pa if p is not pa else pb, p)
                exchange([frame], pc if p is not pc else pb, p)
        assert [r.registry()["engine"] for r in (a, b, c)] == [{"draining": False}] * 3
    assert len(a.doc._log) == len(b.doc._log) == 0


def test_mesh_crdt_writes_on_an_old_epoch_survive_two_compactions_they_missed() -> None:
    a, b = Replica("a"), Replica("b")
    pa, pb = SyncProtocol(a.doc), SyncProtocol(b.doc)
    a.store("ea", [(1, 2)])
    exchange([pa.update_frame()], pb, pa)
    pa.maybe_compact(True, min_churn=0, ratio=0.0)
    frame = pa.maybe_compact(True, min_churn=0, ratio=0.0)
    b.store("eb", [(3, 4)])  # still on epoch 0: both epoch frames were lost
    exchange([frame], pb, pa)
    exchange([pb.update_frame()], pa, pb)
    assert a.pairs("eb") == b.pairs("eb") == {3: 4}
    assert a.doc.content == b.doc.content


def test_mesh_crdt_epoch_replies_remember_a_bounded_number_of_senders() -> None:
    a = Replica("a")
    protocol = SyncProtocol(a.doc)
    a.store("e", [(1, 2)])
    protocol.maybe_compact(True, min_churn=0, ratio=0.0)
    for n in range(5000):
        stale = msgpack.packb(["sv", 0, "", f"replica-{n}", b"\x00"])
        assert protocol.on_frame(stale, float(n)) != []  # each old-epoch sender is told the epoch once
    assert len(protocol._epoch_sent) <= 1024
