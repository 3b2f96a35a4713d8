"""The block-set digest replicas compare: equal sets give equal digests, any changed pair a different one."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from index.digest import block_set_digest

U60 = st.integers(min_value=0, max_value=(1 << 60) - 1)
PAIRS = st.dictionaries(U60, U60, min_size=1, max_size=200)


def _digest(pairs: dict[int, int]) -> str:
    return block_set_digest(np.array(list(pairs), dtype=np.uint64), np.array(list(pairs.values()), dtype=np.uint64))


@given(PAIRS, st.randoms())
def test_order_does_not_matter(pairs, rnd):
    items = list(pairs.items())
    rnd.shuffle(items)
    assert _digest(dict(items)) == _digest(pairs)


@given(PAIRS, st.data())
def test_a_changed_or_missing_pair_changes_the_digest(pairs, data):
    engine_hash = data.draw(st.sampled_from(sorted(pairs)))
    changed = {**pairs, engine_hash: pairs[engine_hash] ^ (1 << data.draw(st.integers(0, 59)))}
    assert _digest(changed) != _digest(pairs)
    missing = {h: k for h, k in pairs.items() if h != engine_hash}
    assert _digest(missing) != _digest(pairs)


def test_swapping_keys_between_blocks_changes_the_digest():
    assert _digest({1: 10, 2: 20}) != _digest({1: 20, 2: 10})


def test_an_empty_set_is_zero():
    assert block_set_digest(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)) == "0" * 16 + ":0"
