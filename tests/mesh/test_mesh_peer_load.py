"""Replicas' in-flight reports: decoding bounds, freshness, and the ``ld`` frame between two protocols."""

from __future__ import annotations

import msgpack
import pytest
from doc_replica import Replica
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import peer_load
from mesh.peer_load import PeerLoad
from mesh.sync_protocol import SyncProtocol


def test_totals_sum_fresh_reports_of_live_peers() -> None:
    loads = PeerLoad(max_age_s=2.0)
    loads.update("a", peer_load.encode({"e1": 3, "e2": 1}), now=10.0)
    loads.update("b", peer_load.encode({"e1": 2}), now=11.0)
    assert loads.totals(11.5) == {"e1": 5, "e2": 1}
    assert loads.totals(11.5, live=["b"]) == {"e1": 2}
    assert loads.totals(12.5) == {"e1": 2}  # a's report is older than 2 s
    loads.update("b", peer_load.encode({}), now=12.6)
    assert loads.totals(12.7) == {}


@pytest.mark.parametrize("report", [
    [1, 2], {"e": -1}, {"e": 10**7}, {"e": True}, {"e": 1.5}, {3: 1}, {f"e{i}": 1 for i in range(5000)},
])
def test_malformed_reports_are_refused_and_keep_the_last_good_one(report) -> None:
    loads = PeerLoad()
    loads.update("a", peer_load.encode({"e": 4}), now=0.0)
    with pytest.raises(ValueError):
        loads.update("a", msgpack.packb(report), now=0.5)
    assert loads.totals(1.0) == {"e": 4}


@settings(max_examples=200)
@given(st.binary(max_size=200))
def test_decoding_arbitrary_bytes_gives_a_map_or_value_error(payload: bytes) -> None:
    try:
        decoded = peer_load.decode(payload)
    except ValueError:
        return
    assert all(isinstance(k, str) and 0 <= v <= peer_load.MAX_COUNT for k, v in decoded.items())


def test_load_frames_cross_epochs_and_bad_ones_are_counted() -> None:
    a, b = Replica("a"), Replica("b")
    pa, pb = SyncProtocol(a.doc), SyncProtocol(b.doc)
    a.store("e", [(1, 2)])
    assert pa.maybe_compact(True, min_churn=0, ratio=0.0) is not None  # a moves to a newer epoch than b
    assert pb.on_frame(pa.load_frame({"e": 3}), 5.0) == []
    assert pb.peer_load.totals(5.0) == {"e": 3}
    bad = msgpack.packb(["ld", 0, "", "a", msgpack.packb({"e": "three"})])
    assert pb.on_frame(bad, 5.1) == [] and pb.counters["malformed"] == 1
    assert pb.peer_load.totals(5.2) == {"e": 3}
