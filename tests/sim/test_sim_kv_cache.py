"""Block pool semantics: refcounts, LRU eviction of free cached blocks only, revival, events."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCache


def _fill(cache, hashes):
    blocks = cache.allocate(len(hashes))
    cache.cache_blocks(blocks, hashes, 0, len(hashes), list(range(len(hashes) * cache.block_size)),
                       [None] * len(hashes))
    return blocks


def test_null_block_is_reserved():
    cache = KVCache(num_blocks=5, block_size=4)
    assert cache.usable_blocks == 4
    assert cache.allocate(5) is None
    assert 0 not in [b.block_id for b in cache.allocate(4)]


def test_freed_chain_is_evicted_tail_first_and_lru_across_requests():
    cache = KVCache(num_blocks=7, block_size=2)
    a = _fill(cache, [b"a0", b"a1", b"a2"])
    b = _fill(cache, [b"b0", b"b1", b"b2"])
    cache.drain_events()
    cache.free(a)
    cache.free(b)
    got = cache.allocate(4)
    assert got is not None
    removed = [e.block_hashes[0] for e in cache.drain_events()]
    assert removed == [b"a2", b"a1", b"a0", b"b2"]
    assert cache.is_cached(b"b0") and not cache.is_cached(b"a0")


def test_hit_revives_a_free_cached_block_and_protects_it():
    cache = KVCache(num_blocks=4, block_size=2)
    blocks = _fill(cache, [b"x0", b"x1"])
    cache.free(blocks)
    hit = cache.find_cached_prefix([b"x0", b"x1", b"x2"], max_blocks=3)
    assert [b.block_hash for b in hit] == [b"x0", b"x1"]
    assert cache.evictable_among(hit) == 2
    cache.touch(hit)
    assert cache.num_free == 1
    assert cache.allocate(2) is None
    cache.drain_events()
    assert cache.allocate(1) is not None
    assert cache.drain_events() == []


def test_shared_block_needs_every_reference_released():
    cache = KVCache(num_blocks=3, block_size=2)
    blocks = _fill(cache, [b"s0"])
    cache.touch(blocks)
    cache.free(blocks)
    assert cache.num_free == 1
    cache.free(blocks)
    assert cache.num_free == 2


def test_stored_event_carries_parent_tokens_and_extra_keys():
    cache = KVCache(num_blocks=8, block_size=2)
    blocks = cache.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6]
    cache.cache_blocks(blocks, [b"h0", b"h1", b"h2"], 1, 3, tokens, [("salt",), None, None])
    [ev] = cache.drain_events()
    assert ev == BlockStored([b"h1", b"h2"], b"h0", [3, 4, 5, 6], 2, [None, None])


def test_reset_forgets_hashes_and_announces_it():
    cache = KVCache(num_blocks=4, block_size=2)
    _fill(cache, [b"r0"])
    cache.drain_events()
    cache.reset()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert not cache.is_cached(b"r0")


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "hit"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=150)
@given(ops)
def test_invariants_under_random_operations(operations):
    cache = KVCache(num_blocks=9, block_size=1)
    held: list[list] = []
    counter = 0
    live_hashes: set[bytes] = set()
    for op, n in operations:
        if op == "alloc":
            hashes = [f"h{counter + i}".encode() for i in range(n)]
            counter += n
            blocks = cache.allocate(n)
            if blocks is None:
                assert n > cache.num_free
                continue
            cache.cache_blocks(blocks, hashes, 0, n, list(range(n)), [None] * n)
            held.append(blocks)
        elif op == "free" and held:
            cache.free(held.pop(n % len(held)))
        elif op == "hit" and live_hashes:
            h = sorted(live_hashes)[n % len(live_hashes)]
            hit = cache.find_cached_prefix([h], 1)
            if cache.evictable_among(hit) <= cache.num_free:
                cache.touch(hit)
                held.append(hit)
        for e in cache.drain_events():
            if isinstance(e, BlockStored):
                live_hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert len(e.block_hashes) == 1
                live_hashes.discard(e.block_hashes[0])
        refs = {}
        for blocks in held:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert all(cache.blocks[i].ref_cnt == r for i, r in refs.items())
        assert cache.num_free + len(refs) == cache.usable_blocks
        assert set(cache.free_queue_ids()).isdisjoint(refs)
        assert live_hashes == {h for h in live_hashes if cache.is_cached(h)}
        assert cache.num_cached_blocks == len(live_hashes)
