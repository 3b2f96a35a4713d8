"""MaskTable against a dict (sets, bulk adds and removals, wide interned masks, both lookup paths), and a
PrefixIndex with more holders than a mask word against a per-holder model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.mask_table import _FIRST_PART, MaskTable
from index.prefix_index import PrefixIndex

keys = st.one_of(st.integers(0, 300), st.integers(0, (1 << 60) - 1))
masks = st.one_of(st.integers(1, 7), st.sampled_from([1 << 62, 1 << 63, 1 << 70, (1 << 70) | 1, 1 << 200]))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), keys, st.one_of(st.just(0), masks)),
        st.tuples(st.just("add"), st.lists(st.integers(0, 300), max_size=60), masks),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 300), max_size=60), masks),
        st.tuples(st.just("fill"), st.integers(0, 200), st.integers(1, 300)),
        st.tuples(st.just("drain"), st.integers(0, 200), st.integers(1, 300)),
    ),
    max_size=30,
)


def _probe_paths_unbroken(table: MaskTable) -> bool:
    """Every entry is reachable from its home slot without crossing an empty slot (what lookups rely on)."""
    codes, last = table._codes, table._size - 1
    for slot in range(table._size):
        code = codes[slot]
        if code:
            at = code >> table._shift
            while at != slot:
                if not codes[at]:
                    return False
                at = (at + 1) & last
    return True


def _apply(table: MaskTable, reference: dict[int, int], op: str, arg: object, mask: int) -> None:
    """One operation on the table (by code) and on the reference dict (by own key)."""
    if op == "set":
        table.set(table.code(arg), mask)
        if mask:
            reference[arg] = mask
        else:
            reference.pop(arg, None)
    elif op == "add":
        held = table.add_absent(table.codes(arg), mask)
        expected = []
        for key in arg:
            if key in reference:
                expected.append(table.code(key))
            reference.setdefault(key, mask)
        assert held == expected
    elif op == "remove":
        others = table.remove_equal(table.codes(arg), mask)
        expected = []
        for key in arg:
            if reference.get(key) == mask:
                del reference[key]
            else:
                expected.append(table.code(key))
        assert others == expected
    else:
        for key in range(arg, arg + mask):
            table.set(table.code(key), key % 5 + 1 if op == "fill" else 0)
            if op == "fill":
                reference[key] = key % 5 + 1
            else:
                reference.pop(key, None)


def _reference_drops(reference: dict[int, int], chain: list[int], wanted: int) -> list[tuple[int, int]]:
    drops, alive = [], wanted
    for depth, key in enumerate(chain):
        mask = reference.get(key, 0)
        if alive & ~mask:
            drops.append((depth, alive & ~mask))
            alive &= mask
            if not alive:
                return drops
    return drops + [(len(chain), alive)] if alive else drops


@settings(max_examples=100, deadline=None)
@given(ops, st.integers(1, 7), st.integers(0, 3))
def test_table_behaves_as_a_dict(sequence: list[tuple[str, object, int]], wanted: int, extra: int) -> None:
    table, reference = MaskTable(), {}
    for op, arg, mask in sequence:
        _apply(table, reference, op, arg, mask)
        assert len(table) == len(reference)
    assert _probe_paths_unbroken(table)
    probe = list(reference) + list(range(300, 360))
    assert [table.get(table.code(k)) for k in probe] == [reference.get(k, 0) for k in probe]
    assert table.own_keys(np.array(table.codes(probe), dtype=np.uint64)).tolist() == probe
    assert all(table.own_key(table.code(k)) == k for k in probe)
    # Chains that every mask of the reference holds for a while, walked in Python and with numpy parts.
    held = sorted(k for k, m in reference.items() if m & wanted == wanted)
    for chain in (held, held * 10 + probe, probe[:extra] + held * 10):
        for bits in (wanted, wanted | 1 << 63 | 1 << 70):
            assert table.prefix_drops(chain, bits) == _reference_drops(reference, chain, bits)
    wide = {m for m in reference.values() if m >= 1 << 63}
    assert set(table._wide_ids) == wide  # interned wide masks are released with their last block


def test_keys_sharing_low_bits_still_spread() -> None:
    """Prompts crafted so that their own keys share low bits do not form one long probe run: the best of
    three tables (each draws its own multiplier) is short."""
    crafted = [i << 40 for i in range(5000)]
    runs = []
    for _ in range(3):
        table = MaskTable()
        table.add_absent(table.codes(crafted), 1)
        assert table.prefix_drops(crafted, 1) == [(len(crafted), 1)]
        assert table.add_absent(table.codes(crafted), 1) == table.codes(crafted)
        longest = run = 0
        for slot in range(table._size):
            run = run + 1 if table._codes[slot] else 0
            longest = max(longest, run)
        runs.append(longest)
    assert min(runs) < 100, runs


def test_a_chain_walk_finds_keys_far_from_their_home() -> None:
    """Codes crowded onto one home sit far past it; the compiled walk still finds them exactly, over parts of
    the chain, and stops where a holder drops out."""
    table = MaskTable()
    table._set_multiplier(1)  # not secret: small own keys all share home 0
    crowd = list(range(32))
    table.add_absent(table.codes(crowd), 3)
    table.set(table.code(crowd[-1]), 1)
    reference = dict.fromkeys(crowd, 3) | {crowd[-1]: 1}
    chain = crowd[:-1] * (20 * _FIRST_PART) + crowd
    assert table.prefix_drops(chain, 3) == _reference_drops(reference, chain, 3) == [(len(chain) - 1, 2),
                                                                                     (len(chain), 1)]
    assert _probe_paths_unbroken(table)


def test_bad_keys_and_codes_are_refused() -> None:
    table = MaskTable()
    with pytest.raises(ValueError):
        table.set(0, 1)
    for own_keys in ([1, 1 << 63], [-1]):
        with pytest.raises(ValueError):
            table.codes(own_keys)
    assert len(table) == 0


HOLDERS = [f"e{i}" for i in range(70)]
index_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(HOLDERS), st.lists(st.integers(0, 40), max_size=8)),
        st.tuples(st.just("remove"), st.sampled_from(HOLDERS), st.lists(st.integers(0, 40), max_size=8)),
        st.tuples(st.just("clear"), st.sampled_from(HOLDERS), st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(index_ops)
def test_an_index_of_more_holders_than_a_word_answers_as_a_model(sequence: list[tuple[str, str, list[int]]]) -> None:
    """Holder slots past 62 make masks wider than a table word (interned): stores, removals, clears and the
    longest-prefix lookup still answer as per-holder dicts do. Engine hash h aliases own key h // 2, so two
    hashes of one holder can share an own key (vLLM does not de-duplicate identical blocks)."""
    index = PrefixIndex()
    for name in HOLDERS:  # every holder gets its slot, in order: e63.. hold wide bits
        index.store(name, [(1000, 1000)])
    model = {name: {1000: 1000} for name in HOLDERS}
    for op, name, hashes in sequence:
        if op == "store":
            index.store_many(name, hashes, [h // 2 for h in hashes])
            model[name].update((h, h // 2) for h in hashes)
        elif op == "remove":
            index.remove(name, hashes)
            for h in hashes:
                model[name].pop(h, None)
        else:
            index.clear(name)
            model[name].clear()
    chain = list(range(21)) + [1000]
    expected = {}
    owners: dict[int, list[str]] = {}
    for name, aliases in model.items():
        held = set(aliases.values())
        for key in held:
            owners.setdefault(key, []).append(name)
        depth = next((i for i, key in enumerate(chain) if key not in held), len(chain))
        if depth:
            expected[name] = depth
        assert all(index.holds(name, key) == (key in held) for key in chain)
    assert index.overlap(chain) == expected  # probed key by key
    assert index.overlap(chain + list(range(5000, 5000 + 20 * _FIRST_PART))) == expected  # over parts
    narrow = HOLDERS[:8]  # holders in slots 0-62 only: the compiled walk, finishing in Python at a wide word
    assert index.overlap(chain, narrow) == {name: depth for name, depth in expected.items() if name in narrow}
    unique: dict[str, int] = {}
    for names in owners.values():
        if len(names) == 1:
            unique[names[0]] = unique.get(names[0], 0) + 1
    assert index.unique_blocks() == unique


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(1, 5000))
def test_a_regrown_table_adopted_holds_the_same_blocks_with_room_for_more(
        sequence: list[tuple[str, object, int]], room: int) -> None:
    """Built from a table (as a worker thread would, reading it only), then adopted: the same masks for every
    key, unbroken probe paths, and room for ``room`` more blocks without another doubling."""
    table, reference = MaskTable(), {}
    for op, arg, mask in sequence:
        _apply(table, reference, op, arg, mask)
    before = (list(table._codes), list(table._values))
    regrown = table.regrown(len(table) + room)
    assert (list(table._codes), list(table._values)) == before  # building it changed nothing
    table.adopt(regrown)
    assert len(table) == len(reference) and not table.needs_room(room)
    assert _probe_paths_unbroken(table)
    probe = list(reference) + list(range(300, 360))
    assert [table.get(table.code(k)) for k in probe] == [reference.get(k, 0) for k in probe]
    for op, arg, mask in sequence:  # and it goes on behaving as a dict
        _apply(table, reference, op, arg, mask)
    assert [table.get(table.code(k)) for k in probe] == [reference.get(k, 0) for k in probe]


def test_an_index_adopts_a_regrown_table_only_if_nothing_was_written_since() -> None:
    index = PrefixIndex()
    index.store_many("a", list(range(1, 41)), list(range(101, 141)))
    assert index.needs_room(1000)
    writes = index.writes
    stale = index.regrown(1000)
    index.store_many("b", [7, 8], [101, 500])  # written while the copy was built
    assert not index.adopt(stale, writes)
    assert index.needs_room(1000)
    writes = index.writes
    assert index.adopt(index.regrown(1000), writes) and not index.needs_room(1000)
    assert index.overlap(list(range(101, 141))) == {"a": 40, "b": 1}
    assert index.overlap([500]) == {"b": 1}
    index.remove("a", range(1, 41))
    assert index.overlap(list(range(101, 141))) == {"b": 1}
