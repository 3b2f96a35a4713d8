"""The batched ingest path (merged removal runs, one alias-table call per event, inline mask updates,
incremental unique counts) builds exactly the index the obvious per-event, per-block model builds."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from events.decode import decode_payload
from index.block_hash import KEY_MASK, next_key, root_seed
from index.holders import engine_of
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from events_frames import payload, removed_array, removed_map, stored_array, stored_map  # noqa: E402

MODEL = "tiny"
BLOCK = 2
HOLDERS = ["a", "a#dp1", "b", "c"]
hashes = st.integers(0, 24)


def engine_hash(h: int) -> int:
    """Small labels spread over the u64 range, as vLLM's hashes are."""
    return (h * 0x9E3779B97F4A7C15 + 7) % 2**64


event = st.one_of(
    st.tuples(st.just("stored"), st.one_of(st.none(), hashes), st.lists(hashes, min_size=1, max_size=6),
              st.integers(0, 3), st.sampled_from([stored_map, stored_array])),
    st.tuples(st.just("removed"), st.lists(hashes, min_size=1, max_size=3), st.sampled_from([removed_map,
                                                                                            removed_array])),
    st.tuples(st.just("cleared")),
)
batches = st.lists(st.tuples(st.sampled_from(HOLDERS), st.lists(event, max_size=8)), max_size=12)


class Model:
    """Per holder a dict engine hash -> own key, applied one event and one block at a time."""

    def __init__(self) -> None:
        self.aliases: dict[str, dict[int, int]] = {h: {} for h in HOLDERS}

    def apply(self, holder: str, raw: tuple) -> None:
        aliases = self.aliases[holder]
        if raw[0] == "stored":
            _, parent, blocks, salt, _ = raw
            if parent is None:
                key = root_seed(MODEL)
            elif (key := aliases.get(engine_hash(parent) & KEY_MASK)) is None:
                return
            for i, h in enumerate(blocks):
                key = next_key(key, tokens(blocks, salt)[i * BLOCK : (i + 1) * BLOCK])
                aliases[engine_hash(h) & KEY_MASK] = key
        elif raw[0] == "removed":
            for h in raw[1]:
                aliases.pop(engine_hash(h) & KEY_MASK, None)
        else:
            aliases.clear()

    def unique(self) -> dict[str, int]:
        owners: dict[int, set[str]] = {}
        for holder, aliases in self.aliases.items():
            for key in aliases.values():
                owners.setdefault(key, set()).add(engine_of(holder))
        counts: dict[str, int] = {}
        for engines in owners.values():
            if len(engines) == 1:
                engine = next(iter(engines))
                counts[engine] = counts.get(engine, 0) + 1
        return counts


def tokens(blocks: list[int], salt: int) -> list[int]:
    """A few token patterns, so that chains of different holders meet on the same own keys."""
    return [(h * 3 + salt + j) % 5 for h in blocks for j in range(BLOCK)]


def frame(raw: tuple) -> object:
    if raw[0] == "stored":
        _, parent, blocks, salt, encode = raw
        return encode([engine_hash(h) for h in blocks], None if parent is None else engine_hash(parent),
                      tokens(blocks, salt), BLOCK)
    if raw[0] == "removed":
        return raw[2]([engine_hash(h) for h in raw[1]])
    return ["AllBlocksCleared"]


@settings(max_examples=300, deadline=None)
@given(batches)
def test_batched_ingest_equals_the_per_block_model(sequence):
    store, model = PrefixIndex(), Model()
    ingests = {holder: EngineIngest(holder, MODEL, store) for holder in HOLDERS}
    for seq, (holder, events) in enumerate(sequence):
        ingests[holder].apply(decode_payload(seq, payload([frame(raw) for raw in events])))
        for raw in events:
            model.apply(holder, raw)
        for name in HOLDERS:
            assert store.pairs(name) == model.aliases[name]
        assert store.unique_blocks() == model.unique()
    for name in HOLDERS:
        held = set(model.aliases[name].values())
        for key in held:
            assert store.holds(name, key)
