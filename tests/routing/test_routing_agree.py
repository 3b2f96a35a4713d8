"""Replicas place a prefix nobody holds alike: near-best engines go by the home key's rendezvous order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from gateway.routing import EngineView, RouteRequest, make_policy
from gateway.routing.hashing import rendezvous_order
from gateway.routing.kv_aware import KvAwarePolicy

IDS = [f"e{i}" for i in range(6)]


def replica() -> KvAwarePolicy:
    """kv_aware as a meshed replica runs it."""
    policy = make_policy("kv_aware")
    assert isinstance(policy, KvAwarePolicy)
    policy.agree_with_peers = True
    return policy


def _request(home_key: str, tokens: int = 4000, answer: int | None = None) -> RouteRequest:
    return RouteRequest("m", tokens, tokens // 16, prefix_key=f"{home_key}-user-text", home_key=home_key,
                        max_tokens=answer)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=12), st.integers(0, 5), st.integers(0, 1))
def test_two_replicas_whose_views_differ_by_one_request_place_a_new_prefix_alike(home_key, busy, which):
    """One replica has a request of its own in flight on some engine (the other has not heard of it yet); both
    send a new 4k-token prefix to the same engine, its home key's rendezvous choice. Before, the one that saw the
    request avoided that engine whenever it was the rendezvous choice, and the prefix was computed twice."""
    idle = [EngineView(i, "u", max_num_seqs=64) for i in IDS]
    seen = list(idle)
    seen[busy] = replace(seen[busy], in_flight=1)
    views = (idle, seen) if which else (seen, idle)
    chosen = [replica().choose(_request(home_key), view).chosen for view in views]
    assert chosen[0] == chosen[1] == rendezvous_order(home_key, IDS)[0]
    if busy == IDS.index(chosen[0]):  # a lone router ranks by cost alone: it keeps off the busier engine
        assert make_policy("kv_aware").choose(_request(home_key), seen).chosen != chosen[0]


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 2), min_size=6, max_size=6),
       st.lists(st.integers(0, 2), min_size=6, max_size=6))
def test_replicas_each_placing_its_own_share_of_a_burst_place_a_new_prefix_alike(home_key, mine, theirs):
    """Each replica has up to two requests of its own in flight on every engine (its share of an opening burst,
    not yet heard of by the others): both send a new prefix to its rendezvous choice. Within one request's
    difference, they parted whenever one had sent two more there than the other (seed 2 shape #2: 14 of 27
    prompts computed on two or three engines)."""
    views = [[EngineView(i, "u", max_num_seqs=64, in_flight=n) for i, n in zip(IDS, counts, strict=True)]
             for counts in (mine, theirs)]
    chosen = {replica().choose(_request(home_key), view).chosen for view in views}
    assert chosen == {rendezvous_order(home_key, IDS)[0]}


def test_an_engine_that_would_load_the_requests_adapter_does_not_take_a_new_prefix_by_rendezvous():
    """The adapter's load is in the engine's queue term, which the depth limit does not read: counted among the
    terms every replica sees alike, it keeps the rendezvous choice from costing a load the others avoid."""
    request = _request("k")  # a LoRA request: the planner fills in each engine's load of its adapter
    top = rendezvous_order("k", IDS)[0]
    fleet = [EngineView(i, "u", max_num_seqs=64, adapter_load_s=0.5 if i == top else 0.0) for i in IDS]
    assert replica().choose(request, fleet).chosen != top


def test_a_held_prefix_and_a_clearly_busier_engine_are_not_overruled():
    request = _request("k")
    top = rendezvous_order("k", IDS)[0]
    held = [EngineView(i, "u", exact_blocks=200 if i != top else 0) if i == IDS[-1] or i == top else
            EngineView(i, "u") for i in IDS]
    holder = next(e.id for e in held if e.exact_blocks)
    assert replica().choose(request, held).chosen == holder
    busy = [EngineView(i, "u", max_num_seqs=64, in_flight=12 if i == top else 0) for i in IDS]
    decision = replica().choose(request, busy)
    assert decision.chosen != top and decision.chosen == rendezvous_order("k", [i for i in IDS if i != top])[0]


def test_a_prefix_a_peer_homed_a_moment_ago_goes_home_until_that_home_is_clearly_busier():
    """A peer's placement arrives before any block of it does (its dispatches are shared later): no engine shows
    the prefix, and by cost alone its next request went to whichever engine was least loaded and computed it a
    second time. A lone router, which has no peers, still ranks by cost."""
    home = IDS[3]
    request = _request("k", tokens=400)
    for queued, goes_home in ((1, True), (12, False)):
        fleet = [EngineView(i, "u", max_num_seqs=64, peer_in_flight=queued if i == home else 0) for i in IDS]
        policy, alone = replica(), make_policy("kv_aware")
        for p in (policy, alone):
            p.record_peer_placement("k", home, 25, None)
        assert (policy.choose(request, fleet).chosen == home) is goes_home
        assert alone.choose(request, fleet).chosen != home


def test_replicas_that_share_their_placements_place_new_prefixes_alike():
    """Replica a placed 2 warm-up prompts (its home book heats their engines, and a prefix without a home is
    charged the crowding beside them); replica b placed none. Told a's placements, b prices every engine as a does
    and both place 40 new prefixes alike; on their own books they part on some of them."""
    fleet = [EngineView(i, "u", max_num_seqs=64, num_blocks=2000) for i in IDS]
    a, b, alone = (replica() for _ in range(3))
    placed = []
    a.on_placed = placed.append
    for n in range(2):
        decision = a.choose(_request(f"warm{n}", tokens=300), fleet)
        a.dispatched(decision, decision.chosen)
    for placement in placed:
        b.record_peer_placement(*placement)
    keys = [_request(f"new{n}", tokens=1000, answer=16) for n in range(40)]
    assert [a.choose(k, fleet).chosen for k in keys] == [b.choose(k, fleet).chosen for k in keys]
    assert [a.choose(k, fleet).chosen for k in keys] != [alone.choose(k, fleet).chosen for k in keys]


def test_a_new_prefix_still_keeps_off_the_engines_its_replicas_know_are_busy_with_homes():
    """The rendezvous choice competes only among engines whose crowding is as low as the best one's: the
    agreement once overrode the crowding term, and new prefixes piled onto engines holding hot homes (seed 0
    shape #6, one router: 0.58 of the bound)."""
    fleet = [EngineView(i, "u", max_num_seqs=64, num_blocks=2000) for i in IDS]
    policy = replica()
    busy = IDS[0]
    for engine in [*IDS, busy, busy]:  # a home on every engine, twice the heat on one
        decision = policy.choose(_request(f"home-{engine}", tokens=300), fleet)
        policy.dispatched(decision, engine)
    keys = [k for k in (f"new{n}" for n in range(200)) if rendezvous_order(k, IDS)[0] == busy][:10]
    assert keys
    assert all(policy.choose(_request(k, tokens=1000, answer=16), fleet).chosen != busy for k in keys)
