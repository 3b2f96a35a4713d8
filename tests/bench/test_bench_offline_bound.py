"""The offline bound: homes sized to load and fitted to caches, replayed through the sim's LRU cache."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.offline_bound import Fleet, TraceRequest, offline_bound, plan_homes, replay, shared_blocks
from bench.workloads import partitioned_prompts
from sim.profiles import get_profile

BLOCK = 16


def _trace(prefixes: int, prefix_tokens: int, asks: int, seed: int = 0) -> list[TraceRequest]:
    """``asks`` requests per prefix in random order: a shared prefix, then a private question."""
    rng = random.Random(seed)
    heads = [tuple(rng.randrange(50_000) for _ in range(prefix_tokens)) for _ in range(prefixes)]
    out = [TraceRequest(f"p{p}", heads[p] + tuple(rng.randrange(50_000) for _ in range(24)), 16)
           for p in range(prefixes) for _ in range(asks)]
    rng.shuffle(out)
    return out


def _fleet(engines: int, blocks: int = 160, concurrency: int = 4) -> Fleet:
    return Fleet(engines, blocks, BLOCK, get_profile("a40-qwen1.5b"), concurrency=concurrency)


def test_shared_blocks_are_the_common_leading_whole_blocks():
    trace = _trace(2, 900, 3)
    assert shared_blocks(trace, BLOCK) == {"p0": 900 // BLOCK, "p1": 900 // BLOCK}


def test_six_long_prompts_on_three_small_caches_one_home_each_hit_nearly_always():
    """The workload's shape: one home per prompt fits, so only each prompt's first request misses."""
    trace = _trace(6, 900, 15)
    bound = offline_bound(trace, _fleet(3))
    assert sorted(len(h) for h in bound.homes.values()) == [1] * 6
    assert bound.hit_rate > 0.85
    assert bound.ttft_p50 <= bound.ttft_p90


def test_everything_on_every_engine_thrashes_in_the_same_replay():
    """The replay is the sim's LRU cache: holding all six prompts everywhere (round robin's outcome) evicts."""
    trace = _trace(6, 900, 15)
    everywhere = {f"p{p}": (0, 1, 2) for p in range(6)}
    homed = offline_bound(trace, _fleet(3))
    assert replay(trace, everywhere, _fleet(3))[0] < homed.hit_rate - 0.3


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.integers(1, 40), min_size=1, max_size=8), sizes=st.lists(st.integers(1, 80), min_size=8,
       max_size=8), engines=st.integers(1, 8), limit=st.floats(1.0, 100.0))
def test_plan_gives_every_prefix_distinct_homes_sized_to_its_load(loads, sizes, engines, limit):
    named = {f"p{i}": n for i, n in enumerate(loads)}
    homes = plan_homes(named, {f"p{i}": sizes[i] for i in range(len(loads))}, engines, 150, limit)
    for prefix, count in named.items():
        assert 1 <= len(homes[prefix]) <= engines
        assert len(set(homes[prefix])) == len(homes[prefix])
        assert all(0 <= e < engines for e in homes[prefix])
        assert len(homes[prefix]) == min(engines, max(1, math.ceil(count / limit)))


def test_the_workload_is_seeded_and_has_the_issue_shape():
    convs = partitioned_prompts(3)
    assert [c.key for c in convs] == [c.key for c in partitioned_prompts(3)]
    assert len(convs) == 90 and len({c.system for c in convs}) == 6
    assert [c.key for c in convs[:15]] != sorted(c.key for c in convs[:15])


def test_a_conversations_turns_stay_where_its_history_is():
    """Two homes for one prefix: without sessions the replay alternates a chat's turns between them and each turn
    recomputes the history the other engine holds; with sessions every later turn finds its history."""
    rng = random.Random(3)
    system = tuple(rng.randrange(50_000) for _ in range(320))
    trace = []
    for chat in range(4):
        history = system
        for _turn in range(4):
            history = history + tuple(rng.randrange(50_000) for _ in range(200))
            trace.append(TraceRequest("sys", history, 16, f"chat{chat}"))
    homes = {"sys": (0, 1)}
    sticky, _ = replay(trace, homes, _fleet(2, blocks=400))
    loose, _ = replay([TraceRequest(r.prefix, r.prompt_ids, r.max_tokens) for r in trace], homes, _fleet(2, blocks=400))
    assert sticky > loose + 0.1
