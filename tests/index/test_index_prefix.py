"""PrefixIndex against a brute-force reference under random store/remove/clear sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from index.prefix_index import PrefixIndex

ENGINES = ["a", "b", "c", "d"]
hashes = st.integers(0, 15)
keys = st.integers(0, 11)
ops = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(ENGINES), st.lists(st.tuples(hashes, keys), max_size=6)),
    st.tuples(st.just("remove"), st.sampled_from(ENGINES), st.lists(hashes, max_size=6)),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES), st.just(None)),
)


class Reference:
    """The obvious model: per engine a dict engine_hash -> own_key; holds = own key among its values."""

    def __init__(self) -> None:
        self.aliases: dict[str, dict[int, int]] = {}

    def apply(self, op: str, engine: str, arg: list) -> None:
        aliases = self.aliases.setdefault(engine, {})
        if op == "store":
            for engine_hash, own_key in arg:
                aliases[engine_hash] = own_key
        elif op == "remove":
            for engine_hash in arg:
                aliases.pop(engine_hash, None)
        else:
            aliases.clear()

    def overlap(self, chain: list[int], engines: list[str]) -> dict[str, int]:
        result = {}
        for engine in engines:
            held = set(self.aliases.get(engine, {}).values())
            depth = 0
            while depth < len(chain) and chain[depth] in held:
                depth += 1
            if depth:
                result[engine] = depth
        return result


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40), st.lists(st.lists(keys, max_size=8), min_size=1, max_size=4),
       st.lists(st.sampled_from(ENGINES), unique=True))
def test_overlap_matches_reference(sequence, chains, subset):
    index, ref = PrefixIndex(), Reference()
    for op, engine, arg in sequence:
        getattr(index, op)(engine, *([] if arg is None else [arg]))
        ref.apply(op, engine, arg)
        for engine_name in ENGINES:
            assert index.block_count(engine_name) == len(ref.aliases.get(engine_name, {}))
    for chain in chains:
        assert index.overlap(chain) == ref.overlap(chain, ENGINES)
        assert index.overlap(chain, subset) == ref.overlap(chain, subset)
    for engine in ENGINES:
        for engine_hash in range(16):
            assert index.own_key(engine, engine_hash) == ref.aliases.get(engine, {}).get(engine_hash)
        for key in range(12):
            assert index.holds(engine, key) == (key in ref.aliases.get(engine, {}).values())
    assert index.engines() == sorted(e for e, a in ref.aliases.items() if a)


def test_many_engines_use_distinct_bits_and_release_slots():
    index = PrefixIndex()
    chain = [1, 2, 3]
    for i in range(70):
        index.store(f"e{i}", [(100 + j, key) for j, key in enumerate(chain[: 1 + i % 3])])
    result = index.overlap(chain)
    assert len(result) == 70
    assert all(result[f"e{i}"] == 1 + i % 3 for i in range(70))
    for i in range(0, 70, 2):
        index.clear(f"e{i}")
    index.store("late", [(1, 1), (2, 2)])
    result = index.overlap(chain)
    assert result["late"] == 2
    assert set(result) == {f"e{i}" for i in range(1, 70, 2)} | {"late"}


def test_unknown_engines_and_empty_chain():
    index = PrefixIndex()
    index.store("a", [(1, 10)])
    assert index.overlap([], ["a"]) == {}
    assert index.overlap([10], ["nobody"]) == {}
    assert index.remove("nobody", [1]) == 0
    assert index.clear("nobody") == 0


WIDE_HOLDERS = [f"h{i}" for i in range(66)]
"""More holders than a mask word's bits: the last ones take the interned-mask paths."""
array_ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WIDE_HOLDERS), st.lists(st.tuples(hashes, keys), max_size=6)),
    st.tuples(st.just("remove"), st.sampled_from(WIDE_HOLDERS), st.lists(hashes, max_size=6)),
), max_size=60)


@settings(max_examples=60, deadline=None)
@given(array_ops)
def test_an_index_fed_u64_arrays_holds_what_one_fed_lists_holds(sequence):
    """An ingest process's notes reach the serving index as u64 arrays (events/worker_notes.py)."""
    lists, arrays = PrefixIndex(), PrefixIndex()
    for holder in WIDE_HOLDERS:  # every holder gets its slot first, so the last ones are past the word
        lists.store_many(holder, [99], [99])
        arrays.store_many(holder, np.array([99], dtype=np.uint64), np.array([99], dtype=np.uint64))
    for op, holder, arg in sequence:
        if op == "store":
            engine_hashes, own_keys = [h for h, _ in arg], [k for _, k in arg]
            assert lists.store_many(holder, engine_hashes, own_keys) == arrays.store_many(
                holder, np.array(engine_hashes, dtype=np.uint64), np.array(own_keys, dtype=np.uint64))
        else:
            assert lists.remove(holder, arg) == arrays.remove(holder, np.array(arg, dtype=np.uint64))
    for holder in WIDE_HOLDERS:
        assert arrays.pairs(holder) == lists.pairs(holder)
    assert arrays.unique_blocks() == lists.unique_blocks()
    assert arrays.overlap(list(range(12)) + [99]) == lists.overlap(list(range(12)) + [99])
