"""What an offline planner that knows the whole trace could reach on a fleet of simulated engines (sans-IO).

The planner gives every shared prefix a set of home engines: as many homes as its share of the requests
needs under a per-engine load limit, placed so that each engine's homes fit its KV cache after a reserve
for the requests running at once. The trace is then replayed, request by request in its order, through
the simulated engines' own scheduler and paged LRU cache (``sim.engine_core``, ``sim.kv_cache``), each
request on the home of its prefix that served the fewest so far (a conversation's later turns on the engine its
first turn went to). Several load limits are tried and the
plan with the best hit rate is the bound. Requests run one at a time on idle engines, so the TTFTs are
those of the cost model without queueing: a floor no online router reaches, next to a hit rate that a
good one comes close to.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.stats import percentile
from sim.engine_core import EngineCore, SimRequest
from sim.kv_cache import KVCache
from sim.profiles import Profile

LOAD_SLACKS = (1.0, 1.25, 1.5, 2.0, 3.0)
"""Per-engine load limits tried, as multiples of the fleet's mean load per engine."""
_VOCAB = tuple(range(1000, 2000))
"""Token ids for generated answers: unique per request either way, so their values do not matter."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: the shared prefix it belongs to, its prompt's token ids, its answer cap."""

    prefix: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    session: str = ""
    """A conversation's turns share it: they stay on the engine its first turn went to, which holds its history
    (empty: a single request)."""


@dataclass(frozen=True, slots=True)
class Fleet:
    engines: int
    num_blocks: int
    block_size: int
    profile: Profile
    time_scale: float = 1.0
    concurrency: int = 1
    max_num_seqs: int = 64


@dataclass(frozen=True, slots=True)
class Bound:
    hit_rate: float
    """Token-level prefix-cache hit rate of the whole fleet (the engines' own counters)."""
    ttft_p50: float
    ttft_p90: float
    homes: dict[str, tuple[int, ...]]
    load_slack: float


def shared_blocks(trace: Sequence[TraceRequest], block_size: int) -> dict[str, int]:
    """Blocks every request of a prefix starts with (its common leading tokens, in whole blocks)."""
    common: dict[str, tuple[int, ...]] = {}
    for r in trace:
        seen = common.get(r.prefix)
        if seen is None:
            common[r.prefix] = r.prompt_ids
            continue
        n = 0
        for a, b in zip(seen, r.prompt_ids, strict=False):
            if a != b:
                break
            n += 1
        common[r.prefix] = seen[:n]
    return {p: len(ids) // block_size for p, ids in common.items()}


def private_blocks(trace: Sequence[TraceRequest], block_size: int, shared: dict[str, int]) -> int:
    """Blocks the largest request needs beyond its shared prefix (question and answer)."""
    return max((math.ceil((len(r.prompt_ids) + r.max_tokens) / block_size) - shared[r.prefix] for r in trace),
               default=0)


def plan_homes(loads: dict[str, int], sizes: dict[str, int], engines: int, room_blocks: int,
               load_limit: float) -> dict[str, tuple[int, ...]]:
    """Homes per prefix: ``ceil(load / load_limit)`` of them (at most one per engine), hottest and largest
    first, each on the engine with the most free room among those with room for it and the least load,
    or, when none has room, the one with the most room left (it will thrash; the replay shows how much)."""
    room = [room_blocks] * engines
    load = [0.0] * engines
    homes: dict[str, list[int]] = {p: [] for p in loads}
    replicas = []
    for prefix, count in loads.items():
        copies = min(engines, max(1, math.ceil(count / max(load_limit, 1e-9))))
        replicas += [(prefix, count / copies)] * copies
    replicas.sort(key=lambda pr: (-sizes[pr[0]] * pr[1], pr[0]))
    for prefix, share in replicas:
        free = [e for e in range(engines) if e not in homes[prefix]]
        fits = [e for e in free if room[e] >= sizes[prefix] and load[e] + share <= load_limit + 1e-9]
        engine = (min(fits, key=lambda e: (load[e], -room[e], e)) if fits
                  else max(free, key=lambda e: (room[e], -load[e], -e)))
        homes[prefix].append(engine)
        room[engine] -= sizes[prefix]
        load[engine] += share
    return {p: tuple(h) for p, h in homes.items()}


def replay(trace: Sequence[TraceRequest], homes: dict[str, tuple[int, ...]], fleet: Fleet) -> tuple[float, list[float]]:
    """(fleet hit rate, TTFT per request) of the trace served one request at a time on the planned homes."""
    cores = [EngineCore(KVCache(fleet.num_blocks, fleet.block_size), fleet.profile, fleet.max_num_seqs, _VOCAB)
             for _ in range(fleet.engines)]
    served = Counter[int]()
    sessions: dict[str, int] = {}
    ttfts = []
    for i, r in enumerate(trace):
        engine = sessions.get(r.session) if r.session else None
        if engine is None:
            engine = min(homes[r.prefix], key=lambda e: (served[e], e))
            if r.session:
                sessions[r.session] = engine
        served[engine] += 1
        core = cores[engine]
        core.add(SimRequest(f"r{i}", list(r.prompt_ids), max(1, r.max_tokens), "length", random.Random(i)))
        elapsed, first = 0.0, None
        while core.has_work():
            step = core.step()
            elapsed += step.duration
            if first is None and step.outputs:
                first = elapsed
        ttfts.append((fleet.profile.frontend_s + (first or elapsed)) * fleet.time_scale)
    queries = sum(c.stats.prefix_queries for c in cores)
    hits = sum(c.stats.prefix_hits for c in cores)
    return (hits / queries if queries else math.nan), ttfts


def offline_bound(trace: Sequence[TraceRequest], fleet: Fleet) -> Bound:
    """The best of the plans over ``LOAD_SLACKS``: highest hit rate, then lowest TTFT p50."""
    sizes = shared_blocks(trace, fleet.block_size)
    loads = dict(Counter(r.prefix for r in trace))
    running_per_engine = math.ceil(fleet.concurrency / max(1, fleet.engines))
    room = fleet.num_blocks - 1 - running_per_engine * private_blocks(trace, fleet.block_size, sizes)
    best: Bound | None = None
    for slack in LOAD_SLACKS:
        homes = plan_homes(loads, sizes, fleet.engines, room, slack * len(trace) / max(1, fleet.engines))
        hit, ttfts = replay(trace, homes, fleet)
        candidate = Bound(hit, percentile(ttfts, 50), percentile(ttfts, 90), homes, slack)
        if best is None or (candidate.hit_rate, -candidate.ttft_p50) > (best.hit_rate, -best.ttft_p50):
            best = candidate
    assert best is not None
    return best
