"""The simulated engine's CPU tier: write-through offload, reload on hit with its copy time, vLLM's events."""

import random

from events.decode import decode_payload
from index.block_hash import chain, root_seed
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex
from index.tiers import TierRun
from index.view import CacheView
from index.vllm_hash import block_hashes
from sim.cpu_tier import CpuTier
from sim.engine_core import EngineCore, SimRequest
from sim.event_encoding import encode_batch
from sim.kv_cache import BlockRemoved, BlockStored, KVCache
from sim.profiles import get_profile

VOCAB = list(range(10, 100))
A = list(range(1, 22))  # 5 full blocks of 4
B = list(range(100, 127))  # 7 full blocks with its answer's token


def make_core(tier_blocks=16, block_load_s=1.0):
    return EngineCore(KVCache(8, 4), get_profile("fast"), 4, VOCAB, "seed", CpuTier(tier_blocks, block_load_s))


def run(core, rid, prompt):
    core.add(SimRequest(rid, list(prompt), 1, "length", random.Random(rid)))
    steps = []
    while core.has_work():
        steps.append(core.step())
    return steps


def events(steps, kind, medium):
    return [e for s in steps for e in s.events if isinstance(e, kind) and e.medium == medium]


def test_blocks_the_gpu_evicted_are_loaded_from_the_cpu_tier_with_their_copy_time():
    core = make_core()
    first = run(core, "a", A)
    run(core, "b", B)  # 7 usable GPU blocks: B's evict A's
    assert not core.cache.is_cached(block_hashes(A, 4, seed="seed")[0])
    again = run(core, "a2", A)
    assert again[-1].outputs[-1].cached_tokens == 20, "all 5 blocks come back from the CPU tier"
    assert core.stats.prefix_hits == 0, "vLLM's prefix-cache hit counter is the GPU cache's alone"
    assert 5.0 <= again[0].duration < 5.1, "5 blocks at 1 s each, next to a 1-token prefill"
    assert sum(s.duration for s in first) < 0.1
    hashes = block_hashes(A, 4, seed="seed")
    offloaded = events(first, BlockStored, "CPU")
    assert [h for e in offloaded for h in e.block_hashes] == hashes
    assert offloaded[0].parent_block_hash is None and offloaded[0].token_ids == A[:20]
    reloaded = events(again, BlockStored, "GPU")
    assert [h for e in reloaded for h in e.block_hashes] == hashes, "loaded blocks are cached in the GPU again"
    assert events(again, BlockStored, "CPU") == [], "blocks already in the tier are not stored twice"


def test_the_tier_is_lru_and_announces_each_drop():
    core = make_core(tier_blocks=6)
    run(core, "a", A)
    steps = run(core, "b", B)
    removals = events(steps, BlockRemoved, "CPU")
    assert all(len(e.block_hashes) == 1 for e in removals), "one event per dropped block"
    dropped = [e.block_hashes[0] for e in removals]
    assert dropped[:5] == block_hashes(A, 4, seed="seed"), "the least recently used leave first"
    assert len(core.tier) == 6


def test_the_routers_index_reads_the_tier_from_the_sims_own_events():
    core = make_core()
    steps = run(core, "a", A) + run(core, "b", B)
    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True)
    ingest = EngineIngest("e", "m", view.store)
    for seq, step in enumerate(steps):
        stats = ingest.apply(decode_payload(seq, encode_batch(0.0, step.events)))
        assert stats.orphaned == stats.skipped == 0
    found = view.overlaps({4: chain(A, 4, root_seed("m"))}, ["e"], now=0.0)["e"]
    assert (found.exact_blocks, found.tiers) == (0, (TierRun("CPU", 5),))
