"""A 24-block engine: eviction is announced (BlockRemoved), and a restart starts the seq over at 0."""

from __future__ import annotations

import pytest
import zmq
from vllm_wire import EventTap, chat, post_json, replay, tokenize_chat, unique_text

from cluster.vllm_engine import VllmEngine, process_group_rss
from index.events import AllBlocksCleared, BlockRemoved

pytestmark = pytest.mark.vllm

BLOCK = 32


def test_a_full_cache_announces_evicted_blocks(tiny_engine: VllmEngine, tiny_tap: EventTap) -> None:
    chains = []
    # Each prompt takes ~9 of the 24 blocks: the third one only fits by evicting the first one's blocks.
    for _ in range(4):
        messages = [{"role": "user", "content": unique_text(100)}]
        tokens = tokenize_chat(tiny_engine, messages, add_generation_prompt=True)
        assert 8 * BLOCK <= len(tokens) < 12 * BLOCK
        chat(tiny_engine, messages)
        chains.append(tiny_tap.chain_for(tokens, BLOCK))
    removals = [e for batch in tiny_tap.batches for e in batch.events if isinstance(e, BlockRemoved)]
    assert {h for e in removals for h in e.block_hashes} & set(chains[0]), "oldest prompt never evicted"
    assert all(e.medium == "GPU" for e in removals)


def test_reset_prefix_cache_announces_all_blocks_cleared(tiny_engine: VllmEngine, tiny_tap: EventTap) -> None:
    post_json(tiny_engine, "/reset_prefix_cache", {})
    tiny_tap.wait_for(lambda batch: any(isinstance(e, AllBlocksCleared) for e in batch.events), kick=tiny_tap.kick)


def test_restart_starts_the_seq_over(
    tiny_engine: VllmEngine, tiny_tap: EventTap, zmq_context: zmq.Context
) -> None:
    tiny_tap.wait_for(lambda batch: batch.seq > 0, kick=tiny_tap.kick)
    last = max(batch.seq for batch in tiny_tap.batches)
    assert tiny_engine.process is not None
    old_group = tiny_engine.process.pid
    tiny_engine.restart()
    assert process_group_rss(old_group) == 0, "a process of the stopped engine survived"
    # The SUB reconnects by itself; the first batch it sees from the new process has a lower seq.
    tiny_tap.wait_for(lambda batch: batch.seq < last, kick=tiny_tap.kick)
    assert replay(tiny_engine, zmq_context, 0)[0].seq == 0
