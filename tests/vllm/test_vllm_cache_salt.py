"""`cache_salt` on a real engine: what BlockStored carries, how it hashes, and that tenants never share."""

from __future__ import annotations

import pytest
from vllm_wire import EventTap, chat, metric, tokenize_chat, unique_text, wait_metric

from cluster.vllm_engine import HASH_SEED, VllmEngine
from index.block_hash import engine_hash_to_int
from index.vllm_hash import block_hashes, hash_block, none_hash, to_u64

pytestmark = pytest.mark.vllm

BLOCK = 32
HITS = "vllm:prefix_cache_hits_total"


def tagged_salt_chain(tokens: list[int], salt: str) -> list[bytes]:
    """vLLM hashes block 0 with the tagged extra keys (("cache_salt", salt),) but publishes them untagged."""
    chain: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        extra = (("cache_salt", salt),) if i == 0 else None
        chain.append(hash_block(chain[-1] if chain else none_hash(HASH_SEED), tokens[i * BLOCK:(i + 1) * BLOCK], extra))
    return chain


def test_salted_blocks_carry_the_salt_and_hash_with_it(engines: list[VllmEngine], taps: list[EventTap]) -> None:
    engine, tap = engines[0], taps[0]
    messages = [{"role": "user", "content": unique_text(80)}]
    tokens = tokenize_chat(engine, messages, add_generation_prompt=True)
    start = len(tap.frames)
    chat(engine, messages, cache_salt="tenant-a")
    chain = tap.chain_for(tokens, BLOCK)
    blocks = tap.stored_blocks()
    # The event carries the salt of the first block only, as the bare string.
    assert blocks[chain[0]][2] == ("tenant-a",)
    assert all(blocks[h][2] is None for h in chain[1:])
    salted = [to_u64(h) for h in tagged_salt_chain(tokens, "tenant-a")]
    assert set(salted) <= tap.raw_stored_hashes(start)
    assert chain == [engine_hash_to_int(h) for h in salted]
    unsalted = [to_u64(h) for h in block_hashes(tokens, BLOCK, seed=HASH_SEED)]
    assert not set(unsalted) & set(salted), "the salt must change every block of the chain"


def test_different_salts_never_share_cached_blocks(engines: list[VllmEngine]) -> None:
    engine = engines[1]
    messages = [{"role": "user", "content": unique_text(80)}]
    # A full hit still recomputes the last prompt token, so the hit is every full block before it.
    cached = (len(tokenize_chat(engine, messages, add_generation_prompt=True)) - 1) // BLOCK * BLOCK
    assert cached >= 3 * BLOCK

    chat(engine, messages, cache_salt="tenant-a")
    start = metric(engine, HITS)
    chat(engine, messages, cache_salt="tenant-a")
    after_same = wait_metric(engine, HITS, start + cached)
    assert after_same == start + cached

    chat(engine, messages, cache_salt="tenant-b")
    chat(engine, messages)
    # A last same-salt hit marks the point where every earlier request's hits have been recorded.
    chat(engine, messages, cache_salt="tenant-a")
    final = wait_metric(engine, HITS, after_same + cached)
    assert final == after_same + cached, "another salt (or no salt) reused tenant-a's blocks"
