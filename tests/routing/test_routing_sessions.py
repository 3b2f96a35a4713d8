"""Conversations' histories per engine (gateway/routing/sessions.py) and kv_aware moving sessions out of an
engine whose returning sessions outgrow its cache."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import EngineView, RouteRequest, make_policy
from gateway.routing.sessions import SessionBook, SessionSettings

CAPACITY = 260
SYSTEM_BLOCKS = 20
TURN_BLOCKS = 8


def _prefill(blocks: int) -> float:
    return 0.001 * blocks


def test_a_first_request_is_charged_nothing_and_single_requests_keep_nothing():
    book = SessionBook()
    assert not book.continues("s") and book.overflow_s("s", "e0", 500, 500, 10, _prefill) == 0.0
    for i in range(50):
        book.record(f"q{i}", "e0", 100, 20)
    assert book.kept_blocks("e0") == 0 and book.continues("q45")
    # the 49 other questions keep nothing there: q45's own 80 private blocks and 8 new ones are all that count
    assert book.overflow_s("q45", "e0", 100, 8, 200, _prefill) == 0.0
    assert book.overflow_s("q45", "e0", 100, 8, 50, _prefill) == pytest.approx(_prefill(100) * (88 - 42.5) / 88)


def test_returning_sessions_count_their_private_blocks_and_overflow_only_where_they_outgrow_the_cache():
    book = SessionBook(SessionSettings(fill=1.0))
    for turn in range(3):
        for s in range(3):
            book.record(f"s{s}", "e0", SYSTEM_BLOCKS + TURN_BLOCKS * (turn + 1), 0 if s == 0 else SYSTEM_BLOCKS)
    # s0 brought the system prompt (its 44 blocks are its own), s1 and s2 read it: 44 + 24 + 24
    assert book.kept_blocks("e0") == 92
    assert book.overflow_s("s1", "e0", 52, 8, 100, _prefill) == 0.0  # 92 + 8 fits 100
    # 92 + 9 does not: one block over, of the 24 + 9 that s1 keeps there
    assert book.overflow_s("s1", "e0", 52, 9, 100, _prefill) == pytest.approx(_prefill(52) / 33)
    assert book.overflow_s("s1", "e0", 52, 9, 60, _prefill) == _prefill(52)  # 41 over: all of it
    assert book.overflow_s("s1", "e1", 52, 52, 100, _prefill) == 0.0  # e1 keeps nobody's history
    assert book.overflow_s("s1", "e1", 52, 52, 26, _prefill) == pytest.approx(_prefill(52) / 2)  # 26 over, of 52


def test_a_moved_session_leaves_its_blocks_behind_and_forgotten_ones_stop_counting():
    book = SessionBook(SessionSettings(forget_after=4))
    for turn in range(2):
        for s in range(2):
            book.record(f"s{s}", "e0", 30 + turn * 10, 10)
    assert book.kept_blocks("e0") == 60
    book.record("s0", "e1", 50, 0)
    assert book.kept_blocks("e0") == 30 and book.kept_blocks("e1") == 0  # s0 is new on e1: seen once there
    book.record("s0", "e1", 60, 0)
    assert book.kept_blocks("e1") == 60
    for i in range(5):  # s1 came back after 2 of e0's placements: silent for 2 x 2 + 2 more, it is gone
        book.record(f"other{i}", "e0", 10, 0)
    assert book.kept_blocks("e0") == 0 and not book.continues("s1")
    book.forget_engine("e1")
    assert book.kept_blocks("e1") == 0 and not book.continues("s0")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 300), st.integers(0, 300)),
                max_size=200))
def test_kept_blocks_are_the_private_blocks_of_the_live_returning_sessions(records):
    """A model of the book: per engine its sessions in order of their last placement, each with its shared blocks,
    latest size, turns, last placement and when it is due to be forgotten."""
    config = SessionSettings(forget_after=6, max_sessions=8)
    book = SessionBook(config)
    engines: dict[str, dict[str, list[int]]] = {}  # engine -> session -> [shared, size, turns, seen, due]
    placed: dict[str, int] = {}
    for s, e, blocks, shared in records:
        session, engine = f"s{s}", f"e{e}"
        book.record(session, engine, blocks, shared)
        now = placed[engine] = placed.get(engine, 0) + 1
        for other, sessions in list(engines.items()):
            if other != engine:
                sessions.pop(session, None)
        mine = engines.setdefault(engine, {})
        state = mine.pop(session, None)
        if state is None:
            state = [min(shared, blocks), blocks, 0, now, now + config.forget_after]
        else:
            gap = now - state[3]
            state = [state[0], blocks, state[2] + 1, now,
                     now + min(config.forget_after, int(config.late_turns * gap) + config.late_slack)]
        mine[session] = state
        for other in [k for k, v in mine.items() if v[4] < now]:
            del mine[other]
        if sum(map(len, engines.values())) > config.max_sessions:
            fullest = max((k for k in engines if engines[k]), key=lambda k: (len(engines[k]), k))
            del engines[fullest][next(iter(engines[fullest]))]
        engines = {k: v for k, v in engines.items() if v}
        for engine_id in (f"e{i}" for i in range(4)):
            expected = sum(max(0, size - shared) for shared, size, turns, _, _ in engines.get(engine_id, {}).values()
                           if turns)
            assert book.kept_blocks(engine_id) == expected
        assert {k for v in engines.values() for k in v} == {f"s{i}" for i in range(13) if book.continues(f"s{i}")}


class _BlockFleet:
    """Engines caching blocks under LRU, as vLLM's prefix cache does: a request's leading blocks present are its
    hit, all of its blocks are touched, and the least recently used go when the engine is full."""

    def __init__(self, engines: int) -> None:
        self.ids = [f"e{i}" for i in range(engines)]
        self.cache: dict[str, OrderedDict[tuple[str, int], None]] = {e: OrderedDict() for e in self.ids}
        self.busy = dict.fromkeys(self.ids, 0)

    def leading(self, engine: str, blocks: list[tuple[str, int]]) -> int:
        held = self.cache[engine]
        return next((i for i, b in enumerate(blocks) if b not in held), len(blocks))

    def views(self, blocks: list[tuple[str, int]]) -> list[EngineView]:
        return [EngineView(e, "u", in_flight=self.busy[e], num_blocks=CAPACITY, exact_blocks=self.leading(e, blocks),
                           held_blocks=len(self.cache[e]), reuse_ratio=0.8) for e in self.ids]

    def serve(self, engine: str, blocks: list[tuple[str, int]]) -> int:
        hit, held = self.leading(engine, blocks), self.cache[engine]
        for b in blocks:
            held.pop(b, None)
            held[b] = None
        while len(held) > CAPACITY:
            held.popitem(last=False)
        return hit


def _conversations(policy) -> list[float]:
    """Six sessions of two system prompts start while the second engine is busy, as at #13's opening; then they
    take turns, each adding a turn to its history. Returns each turn's share of prompt blocks served from cache."""
    fleet = _BlockFleet(2)
    sessions = [(f"s{i}", "AB"[i % 2]) for i in range(6)]
    shares = []
    for turn in range(8):
        fleet.busy["e1"] = 4 if turn == 0 else 0
        hit = total = 0
        for name, prompt in sessions:
            blocks = [(prompt, i) for i in range(SYSTEM_BLOCKS)] + [(name, i) for i in range(TURN_BLOCKS * (turn + 1))]
            request = RouteRequest("m", len(blocks) * 16, len(blocks), f"{prompt}/{name}", max_tokens=16,
                                   home_key=f"sys{prompt}")
            decision = policy.choose(request, fleet.views(blocks))
            policy.dispatched(decision, decision.chosen)
            hit, total = hit + fleet.serve(decision.chosen, blocks), total + len(blocks)
        shares.append(hit / total)
    return shares


def test_sessions_that_outgrow_their_engine_move_to_one_with_room():
    """All six sessions start on e0; from the turn their histories pass its cache, LRU evicts each before its next
    turn unless some move. With the session book they do, and the later turns hit again."""
    moved = _conversations(make_policy("kv_aware"))
    stuck = make_policy("kv_aware")
    stuck.sessions = SessionBook(SessionSettings(fill=1e9))
    piled = _conversations(stuck)
    assert max(piled[-3:]) < 0.35, piled  # the failure the book exists for
    assert min(moved[-3:]) > 0.7, moved


def test_a_peer_counts_the_sessions_another_replica_placed():
    """Placements shared through the mesh carry their conversation, so a replica that saw none of a session's turns
    counts its history where it lives as the replica that placed them does."""
    a, b = make_policy("kv_aware"), make_policy("kv_aware")
    shared = []
    a.on_placed = shared.append
    _conversations(a)
    for placement in shared:
        b.record_peer_placement(*placement)
    kept = [a.sessions.kept_blocks(e) for e in ("e0", "e1")]
    assert sum(kept) > 0 and [b.sessions.kept_blocks(e) for e in ("e0", "e1")] == kept
    assert all(len(p[4]) == 16 and "A/" not in p[4] for p in shared)  # a digest, not the conversation's text


def test_a_failover_engine_is_not_credited_with_what_the_first_ranked_engine_held():
    policy = make_policy("kv_aware")
    placed = []
    policy.on_placed = placed.append
    fleet = _BlockFleet(2)
    blocks = [("A", i) for i in range(SYSTEM_BLOCKS)]
    fleet.serve("e0", blocks)
    request = RouteRequest("m", len(blocks) * 16, len(blocks), "A/s0", max_tokens=16, home_key="sysA")
    decision = policy.choose(request, fleet.views(blocks))
    assert decision.chosen == "e0" and decision.home.shared_blocks == SYSTEM_BLOCKS
    policy.dispatched(decision, "e1")  # e0 failed before its first byte
    policy.dispatched(decision, "e0")
    assert [(p[1], p[5]) for p in placed] == [("e1", 0), ("e0", SYSTEM_BLOCKS)]
