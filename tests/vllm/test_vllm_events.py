"""The real engine's KV-event stream, checked against docs/vllm.md and the project's decoder and hash recipe."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq
from vllm_wire import EventTap, chat, get_text, replay, tokenize_chat, unique_text

from cluster.vllm_engine import HASH_SEED, KV_TOPIC, VllmEngine
from index.block_hash import engine_hash_to_int
from index.events import BlockStored
from index.vllm_hash import block_hashes, to_u64

pytestmark = pytest.mark.vllm

BLOCK = 32


def test_kv_event_sources_describe_the_launch(engines: list[VllmEngine]) -> None:
    engine = engines[0]
    sources = json.loads(get_text(engine, "/kv_event_sources"))
    assert list(sources) == ["0"]
    config = sources["0"]
    assert config["enable_kv_cache_events"] is True
    assert config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://*:{engine.events_port}"
    assert config["replay_endpoint"] == f"tcp://*:{engine.replay_port}"
    assert config["topic"] == KV_TOPIC
    assert config["buffer_steps"] == 10000


def test_live_frames_are_map_encoded_with_u64_hashes(engines: list[VllmEngine], taps: list[EventTap]) -> None:
    tap = taps[0]
    messages = [{"role": "user", "content": unique_text(60)}]
    tokens = tokenize_chat(engines[0], messages, add_generation_prompt=True)
    start = len(tap.frames)
    chat(engines[0], messages)
    tap.chain_for(tokens, BLOCK)
    stored = []
    for topic, seq, payload in tap.frames[start:]:
        assert topic == KV_TOPIC.encode()
        assert len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        stored += [e for e in events if e["type"] == "BlockStored"]
    assert stored, "no BlockStored in the frames of the request"
    for event in stored:
        assert isinstance(event, dict)
        assert event["block_size"] == BLOCK
        assert event["medium"] == "GPU"
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])
        assert len(event["token_ids"]) == BLOCK * len(event["block_hashes"])


def test_seq_increments_by_one_per_batch(engines: list[VllmEngine], taps: list[EventTap]) -> None:
    tap = taps[1]
    start = len(tap.batches)
    for _ in range(3):
        tap.kick()
    tap.wait_for(lambda batch: len(tap.batches) - start >= 3)
    seqs = [batch.seq for batch in tap.batches[start:]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_engine_hashes_follow_the_vllm_recipe(engines: list[VllmEngine], taps: list[EventTap]) -> None:
    messages = [{"role": "system", "content": unique_text(30)}, {"role": "user", "content": unique_text(90)}]
    tokens = tokenize_chat(engines[0], messages, add_generation_prompt=True)
    assert len(tokens) >= 4 * BLOCK
    start = len(taps[0].frames)
    chat(engines[0], messages)
    announced = taps[0].chain_for(tokens, BLOCK)
    on_wire = [to_u64(h) for h in block_hashes(tokens, BLOCK, seed=HASH_SEED)]
    assert set(on_wire) <= taps[0].raw_stored_hashes(start)
    assert announced == [engine_hash_to_int(h) for h in on_wire]


def test_a_prefix_hit_is_silent_unless_full_report_is_asked(
    engines: list[VllmEngine], taps: list[EventTap]
) -> None:
    engine, tap = engines[1], taps[1]
    messages = [{"role": "user", "content": unique_text(80)}]
    tokens = tokenize_chat(engine, messages, add_generation_prompt=True)
    chat(engine, messages)
    chain = tap.chain_for(tokens, BLOCK)
    before = len(tap.batches)
    chat(engine, messages)
    chat(engine, messages, vllm_xargs={"kv_cache_report_mode": "full"})

    def re_announced(batch: object) -> bool:
        return any(isinstance(e, BlockStored) and e.block_hashes[0] == chain[0] for e in batch.events)

    reported = tap.wait_for(re_announced)
    first = next(e for e in reported.events if isinstance(e, BlockStored) and e.block_hashes[0] == chain[0])
    assert first.parent_block_hash is None
    assert list(first.block_hashes[: len(chain)]) == chain
    # Without the report mode the same hit announced nothing about these blocks.
    quiet = tap.batches[before:tap.batches.index(reported)]
    assert not any(re_announced(batch) for batch in quiet)


def test_replay_returns_buffered_batches_then_the_end_marker(
    engines: list[VllmEngine], taps: list[EventTap], zmq_context: zmq.Context
) -> None:
    tap = taps[0]
    tap.kick()
    tap.wait_for(lambda batch: bool(batch.events), kick=tap.kick)
    live = tap.batches[-3:]
    replayed = replay(engines[0], zmq_context, live[0].seq)
    by_seq = {batch.seq: batch for batch in replayed}
    assert [batch.seq for batch in replayed] == sorted(by_seq)
    for batch in live:
        assert by_seq[batch.seq].events == batch.events
