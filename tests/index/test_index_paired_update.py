"""The paired loops over an alias table and the mask table leave both tables holding what the tables' own bulk
methods leave, every entry reachable, and answer the same."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from index.alias_table import AliasTable
from index.mask_table import MaskTable
from index.paired_update import remove_sole, store_new

hashes = st.lists(st.integers(0, 120), max_size=80)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), hashes, st.integers(0, 60), st.integers(1, 6)),
        st.tuples(st.just("remove"), hashes, st.just(0), st.integers(1, 6)),
    ),
    max_size=25,
)


def _contents(aliases: AliasTable, masks: MaskTable) -> tuple[object, ...]:
    """What both tables answer for every own key the test uses (a displaced entry a removal left behind an
    empty slot would read as absent)."""
    return dict(aliases.items()), [masks.get(code) for code in masks.codes(range(90))], len(aliases), len(masks)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_paired_loops_leave_the_tables_as_their_own_methods_do(operations: list) -> None:
    aliases, masks = AliasTable(), MaskTable()
    twin_aliases, twin_masks = copy.deepcopy(aliases), copy.deepcopy(masks)
    for op, engine_hashes, offset, value in operations:
        if op == "store":
            codes = masks.codes([(h * 7 + offset) % 90 for h in engine_hashes])
            held, replaced = store_new(aliases, masks, engine_hashes, codes, value)
            previous = twin_aliases.put_many(engine_hashes, codes)
            new = [code for code, before in zip(codes, previous, strict=True) if before is None]
            assert replaced == [(code, before) for code, before in zip(codes, previous, strict=True)
                                if before is not None]
            assert held.tolist() == twin_masks.add_absent(new, value)
        else:
            popped, others = remove_sole(aliases, masks, engine_hashes, value, 0, {})
            codes = twin_aliases.pop_many(engine_hashes)
            assert popped == len(codes) - codes.count(None)
            assert others.tolist() == twin_masks.remove_equal(codes, value)
        assert _contents(aliases, masks) == _contents(twin_aliases, twin_masks)
