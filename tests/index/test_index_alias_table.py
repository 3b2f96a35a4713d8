"""AliasTable against a dict under random set/pop sequences that cross its grow, sweep and shrink points."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.alias_table import AliasTable

keys = st.one_of(st.integers(0, 300), st.integers(0, (1 << 63) - 1))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), keys, st.integers(0, (1 << 64) - 1)),
        st.tuples(st.just("pop"), keys, st.just(0)),
        st.tuples(st.just("fill"), st.integers(0, 200), st.integers(1, 400)),
        st.tuples(st.just("drain"), st.integers(0, 200), st.integers(1, 400)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_table_behaves_as_a_dict(sequence: list[tuple[str, int, int]]) -> None:
    table, reference = AliasTable(), {}
    for op, key, value in sequence:
        if op == "set":
            table[key] = value
            reference[key] = value
        elif op == "pop":
            assert table.pop(key) == reference.pop(key, None)
        elif op == "fill":
            for k in range(key, key + value):
                table[k] = k * 7
                reference[k] = k * 7
        else:
            for k in range(key, key + value):
                assert table.pop(k) == reference.pop(k, None)
        assert len(table) == len(reference)
    assert dict(table.items()) == reference
    assert sorted(table.values()) == sorted(reference.values())
    for key, value in reference.items():
        assert table.get(key) == value


def test_out_of_range_keys_are_absent_and_refused() -> None:
    table = AliasTable()
    assert table.get(-1) is None and table.pop(1 << 63) is None
    with pytest.raises(ValueError):
        table[1 << 63] = 1
    with pytest.raises(ValueError):
        table[1] = -1
    assert len(table) == 0


def _longest_run(table: AliasTable) -> int:
    longest = run = 0
    words = table._words
    for slot in range(len(words) // 2):
        run = run + 1 if words[2 * slot] else 0
        longest = max(longest, run)
    return longest


def test_keys_sharing_low_bits_still_spread() -> None:
    """Keys an engine could craft to share their low bits do not form one long probe chain.

    Each table draws its own multiplier, and a rare draw spreads these keys badly (one run of 300 tables:
    longest run 143 at worst; a test run here once saw 200 or more): the claim is about the draw, so the best of three
    tables must be short; a broken spread makes all three long."""
    crafted = [i << 40 for i in range(5000)]
    runs = []
    for _ in range(3):
        table = AliasTable()
        for key in crafted:
            table[key] = key
        assert all(table.get(key) == key for key in crafted)
        runs.append(_longest_run(table))
    assert min(runs) < 200, runs


def _probe_paths_unbroken(table: AliasTable) -> bool:
    """Every entry is reachable from its home slot without crossing an empty slot (what lookups rely on)."""
    words, size = table._words, table._size
    for slot in range(size):
        stored = words[2 * slot]
        if stored:
            at = table._home(stored)
            while at != slot:
                if not words[2 * at]:
                    return False
                at = at + 1 if at + 1 < size else 0
    return True


@settings(max_examples=80, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 40))
def test_a_rebuild_places_crowded_entries_that_wrap_past_the_end(rng: random.Random, incoming: int) -> None:
    """Keys whose homes crowd the table's last slots overflow its end when placed at once; the rebuild must
    wrap them so that every entry stays reachable from its home."""
    table, reference = AliasTable(), {}
    table._multiplier = 2  # not secret: a key's home is the sixteenth of the table its top bits name
    for _ in range(rng.randrange(1, 120)):
        key = (rng.choice([0, 7, 14, 15]) << 59) + rng.randrange(1 << 20)
        table[key] = key & 63
        reference[key] = key & 63
    table._rebuild(incoming)
    assert _probe_paths_unbroken(table)
    assert dict(table.items()) == reference and all(table.get(k) == v for k, v in reference.items())


def test_a_rebuild_that_finds_more_live_entries_than_it_counted_fails_instead_of_probing_forever() -> None:
    """A rebuild in a worker thread sizes the new table by the live count it read first; entries written under it
    meanwhile could outnumber the slots, and a probe for a free slot in a full table would never end."""
    table = AliasTable()
    for key in range(20):
        table[key] = key
    table._live = 2  # as if 18 entries arrived after the rebuild read the count (the new table has 8 slots)
    with pytest.raises(RuntimeError, match="written while it was rebuilt"):
        table.rebuilt()
