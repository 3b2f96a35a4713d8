"""vLLM's block-hash recipe: the published test vector, salt placement, incremental == batch."""

import hashlib
import pickle

from hypothesis import given
from hypothesis import strategies as st

from index.vllm_hash import BlockHasher, block_hashes, none_hash, salt_extra_keys, salt_hash_keys, to_u64


def test_sha256_test_vector_from_facts():
    [h] = block_hashes(list(range(16)), 16, seed="vllm-none-hash")
    assert to_u64(h) == 3262291359910021016


def test_recipe_matches_an_independent_recomputation():
    def H(x):
        return hashlib.sha256(pickle.dumps(x, protocol=5)).digest()

    tokens = list(range(100, 148))
    p = H("s")
    want = []
    for i in range(3):
        p = H((p, tuple(tokens[i * 16:(i + 1) * 16]), (("cache_salt", "salty"),) if i == 0 else None))
        want.append(p)
    assert block_hashes(tokens, 16, cache_salt="salty", seed="s") == want


def test_salt_is_hashed_tagged_but_published_bare_in_the_first_block_only():
    assert salt_extra_keys(0, "t1") == ("t1",)
    assert salt_extra_keys(1, "t1") is None
    assert salt_extra_keys(0, None) is None
    assert salt_hash_keys(0, "t1") == (("cache_salt", "t1"),)
    assert salt_hash_keys(1, "t1") is None and salt_hash_keys(0, "") is None


def test_seed_changes_every_hash():
    assert none_hash("a") != none_hash("b")
    assert block_hashes([1] * 16, 16, seed="a") != block_hashes([1] * 16, 16, seed="b")


@given(st.lists(st.integers(0, 4095), max_size=200), st.lists(st.integers(1, 40), max_size=10),
       st.sampled_from([None, "tenant"]))
def test_incremental_extension_equals_one_shot(tokens, cuts, salt):
    h = BlockHasher(8, salt, seed="x")
    pos = 0
    for c in cuts:
        pos = min(len(tokens), pos + c)
        h.extend(tokens[:pos])
    h.extend(tokens)
    assert h.hashes == block_hashes(tokens, 8, salt, seed="x")
    assert len(h.hashes) == len(tokens) // 8
