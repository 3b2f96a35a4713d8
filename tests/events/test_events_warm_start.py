"""A warm start does not trust one peer blindly: a snapshot larger than the engine can hold is refused,
equal progress goes to the peer that lagged least, and the engine starts at reduced confidence (the
more the peer lagged, the lower) until its own events confirm the snapshot."""

from __future__ import annotations

import numpy as np
import trio

from gateway import index_transfer
from gateway.event_ingest import EventIngest
from index.prefix_index import PrefixIndex
from index.view import CacheView

ENGINE = "10.0.0.5:8000"


class Peers:
    """The part of MeshNode a warm start uses: every peer's answer to the index query."""

    def __init__(self, answers: dict[str, bytes | None]) -> None:
        self.answers = answers

    def serve_state(self, namespace, provider) -> None:
        pass

    async def fetch_state(self, namespace, key, timeout_s):
        return self.answers


def blob(seq: int, blocks: int, lag_s: float = 0.0) -> bytes:
    hashes = np.arange(1, blocks + 1, dtype=np.uint64)
    return index_transfer.encode([seq], [hashes], [hashes + np.uint64(1000)], lag_s)


def warm(answers: dict[str, bytes | None], capacity: int) -> tuple[EventIngest, CacheView, tuple]:
    view = CacheView(PrefixIndex())
    view.register(ENGINE, block_size=16, has_events=True)
    ingest = EventIngest(view, Peers(answers))
    resume = trio.run(ingest._warm, ENGINE, (ENGINE,), capacity)
    return ingest, view, resume


def test_a_snapshot_larger_than_the_engine_is_refused_and_the_least_lagging_peer_wins():
    """Before, the highest seq won whatever its size: one peer could hand a starting replica any index."""
    answers = {"huge": blob(seq=90, blocks=500), "lagging": blob(seq=40, blocks=20, lag_s=30.0),
               "fresh": blob(seq=40, blocks=10, lag_s=1.0), "none": None}
    ingest, view, resume = warm(answers, capacity=100)
    assert resume == (40,) and len(view.store.export(ENGINE)[0]) == 10
    assert ingest.stats["bad_snapshot"] == 1


def test_a_snapshot_with_an_own_key_the_index_cannot_hold_is_refused_before_any_block_is_stored():
    """Own keys are below 2**63 (the index keys blocks by a code of the own key); a peer's larger one is a bad
    snapshot, not an exception out of the warm start."""
    hashes = np.arange(1, 4, dtype=np.uint64)
    bad = index_transfer.encode([50], [hashes], [np.array([5, 1 << 63, 7], dtype=np.uint64)])
    ingest, view, resume = warm({"bad": bad, "fresh": blob(seq=40, blocks=10)}, capacity=100)
    assert resume == (40,) and len(view.store.export(ENGINE)[0]) == 10
    assert ingest.stats["bad_snapshot"] == 1


def test_a_warmed_engine_is_trusted_less_until_its_own_events_confirm_it():
    _, view, _ = warm({"peer": blob(seq=7, blocks=10, lag_s=10.0)}, capacity=100)
    freshness = view.info(ENGINE).freshness
    freshness.on_poll(100.0, running=0)
    assert freshness.confidence(100.0) == 0.25  # half for a borrowed index, half again for 10 s of lag
    _, fresh_view, _ = warm({"peer": blob(seq=7, blocks=10)}, capacity=100)
    fresh_view.info(ENGINE).freshness.on_poll(100.0, running=0)
    assert fresh_view.info(ENGINE).freshness.confidence(100.0) == 0.5
    freshness.on_events(101.0, 8)
    assert freshness.confidence(101.0) == 1.0


def test_a_snapshot_says_how_far_the_answering_index_lags():
    freshness = CacheView(PrefixIndex()).register(ENGINE, block_size=16, has_events=True).freshness
    assert freshness.lag(50.0) == 0.0
    freshness.on_deferred(30.0)
    freshness.on_warm(5.0)
    assert freshness.lag(50.0) == 25.0
    decoded = index_transfer.decode(blob(seq=1, blocks=2, lag_s=25.0), sources=1)
    assert decoded.lag_s == 25.0
