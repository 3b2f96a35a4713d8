"""The autoscaler reads each engine's unique blocks from the index's running count, ranks grouped."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.autoscale_link import RouterSignals
from gateway.engines import EngineRegistry
from gateway.metrics import RouterMetrics
from index.prefix_index import PrefixIndex


def test_unique_blocks_follow_stores_and_removals__grouping_ranks():
    store = PrefixIndex()
    store.store("warm", [(1, 10), (2, 11), (3, 12)])
    store.store("warm#dp1", [(7, 12), (8, 13)])  # another rank of the same engine: still its own
    store.store("cold", [(4, 10)])
    reader = RouterSignals(EngineRegistry(), SimpleNamespace(store=store), dict, RouterMetrics().ttft, None)
    assert reader.unique_blocks() == {"warm": 3}  # 11, 12 (on two ranks), 13; block 10 is shared
    store.remove("cold", [4])
    assert reader.unique_blocks() == {"warm": 4}
    store.clear("warm")
    assert reader.unique_blocks() == {"warm": 2}
    store.clear("warm#dp1")
    assert reader.unique_blocks() == {}
