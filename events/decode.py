"""Sans-IO decoding of vLLM KV-event frames (live PUB and replay ROUTER) into typed batches.

Both event encodings are accepted (docs/vllm.md): the map form (vLLM >= ~0.26) and the legacy tagged
array. Unknown fields are ignored, unknown event types are counted and skipped. Anything malformed
raises DecodeError with a short reason that becomes a metrics label; nothing else escapes.

A well-typed map-form batch, what current vLLM sends, is decoded straight into typed structs (msgspec):
the generic unpack into per-event dicts was ~80% of decode. Any batch the typed schema refuses (the
legacy array form, unknown event types, wrong field types, hostile bytes) is decoded again by the generic
path, which alone decides its result or its error, so both paths give the same batch or the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec

from index.block_hash import KEY_MASK, U64_MASK, engine_hash_to_int
from index.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

SEQ_BYTES = 8
END_SEQ = b"\xff" * SEQ_BYTES
MAX_TOKEN_ID = (1 << 32) - 1
MAX_BLOCK_SIZE = 1 << 16
_MAX_EXTRA_DEPTH = 4


class DecodeError(Exception):
    """A frame or payload that cannot be understood; `reason` is a bounded metrics label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The replay server's end-of-stream marker."""


def decode_live(frames: Sequence[bytes]) -> EventBatch:
    """Live PUB message: [topic, seq (u64 BE), payload]."""
    if len(frames) != 3:
        raise DecodeError("frame_count")
    return decode_payload(_seq(frames[1]), frames[2])


def decode_replay(frames: Sequence[bytes]) -> EventBatch | ReplayEnd:
    """Replay reply on a DEALER: [b"", topic, seq, payload] or the pre-0.26 [b"", seq, payload]."""
    if len(frames) == 4 and frames[0] == b"":
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    else:
        raise DecodeError("frame_count")
    if seq_frame == END_SEQ:
        return ReplayEnd()
    return decode_payload(_seq(seq_frame), payload)


def _seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise DecodeError("seq_length")
    return int.from_bytes(frame, "big")


_Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]  # range checked in C while decoding


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int | bytes]
    token_ids: list[_Token]
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
    parent_block_hash: int | bytes | None = None
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()  # rare; unpacked by msgpack exactly as the generic path does
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: int | float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_TYPED = msgspec.msgpack.Decoder(_Batch)
_NIL = b"\xc0"
_NIL_ARRAYS = {bytes([0x90 | n]) + _NIL * n: n for n in range(1, 16)}
"""The extra keys vLLM sends for plain text blocks (one None per block) as msgpack bytes, by block count: a
decode event's are matched whole instead of unpacked into a list to check and drop (0.24 against 0.49 us,
plus two helper calls)."""


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    """msgpack [ts, events, data_parallel_rank] -> EventBatch."""
    try:
        typed = _TYPED.decode(payload)
    except Exception:  # not the typed map form: the generic path decides the result or the reason
        return _decode_generic(seq, payload)
    return EventBatch(seq=seq, ts=float(typed.ts), events=tuple(_typed_events(typed.events)),
                      data_parallel_rank=typed.data_parallel_rank)


def _typed_events(raw_events: list[_Stored | _Removed | _Cleared]) -> list[Event]:
    """The typed twin of `_events`: same runs of BlockRemoved, same checks in the same order. Removals are
    most events (one per evicted block), so their turn of the loop compares medium and group as they come
    instead of building a tuple per event."""
    events: list[Event] = []
    run: list[Any] = []
    medium: Any = None
    group: Any = None
    for raw in raw_events:
        if type(raw) is _Removed:
            hashes = raw.block_hashes
            if not hashes:
                raise DecodeError("block_hashes")
            if run and (raw.medium != medium or raw.group_idx != group):
                events.append(_removed(run, (medium, group)))
                run = []
            medium, group = raw.medium, raw.group_idx
            run += hashes
            continue
        if run:
            events.append(_removed(run, (medium, group)))
            run = []
        if type(raw) is _Stored:
            events.append(_typed_stored(raw))
        else:
            events.append(AllBlocksCleared())
    if run:
        events.append(_removed(run, (medium, group)))
    return events


def _typed_stored(raw: _Stored) -> BlockStored:
    """`_stored_from`'s checks that the schema did not already make (types, block size and token range),
    in the same order, so a refused event gives the same reason. Events without extra keys (nearly all) and
    u64 parents take no helper call: most stored events are single-block decode events, where the calls
    were most of the event's decode."""
    extra: Any = None
    nils = -1
    if raw.extra_keys and raw.extra_keys != _NIL:
        nils = _NIL_ARRAYS.get(bytes(raw.extra_keys), -1)
        if nils < 0:
            try:
                extra = msgpack.unpackb(raw.extra_keys, raw=False, strict_map_key=False)
            except Exception as exc:  # the generic path fails on these bytes before any check
                raise DecodeError("msgpack") from exc
    hashes = _hashes(raw.block_hashes)
    if len(raw.token_ids) != len(hashes) * raw.block_size:
        raise DecodeError("token_ids")
    if extra is not None:
        _check_extra(extra, len(hashes))
    elif nils >= 0 and nils != len(hashes):
        raise DecodeError("extra_keys")
    parent = raw.parent_block_hash
    if parent is not None:
        parent = parent & KEY_MASK if type(parent) is int and 0 <= parent <= U64_MASK else _hash(parent)
    if extra is not None:
        extra = _frozen_extra(extra)
    return BlockStored(hashes, parent, tuple(raw.token_ids), raw.block_size, raw.lora_name, raw.medium, extra,
                       raw.group_idx)


def _decode_generic(seq: int, payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many unrelated types on hostile input
        raise DecodeError("msgpack") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("batch_shape")
    ts, raw_events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(raw_events, list):
        raise DecodeError("batch_shape")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError("batch_shape")
    events, unknown = _events(raw_events)
    return EventBatch(seq=seq, ts=float(ts), events=tuple(events), data_parallel_rank=rank,
                      unknown_events=unknown)


def _events(raw_events: list[Any]) -> tuple[list[Event], int]:
    """Typed events and the count of unknown ones. Consecutive BlockRemoved events of one medium and group
    become one event: vLLM sends one event per evicted block, and a per-event object, check and index call
    cost ~5 us per removed block (a third of ingest on the realistic mix); applying the run at once removes
    the same blocks in the same order."""
    events: list[Event] = []
    unknown = 0
    run: list[Any] = []
    run_where: tuple[Any, Any] = (None, None)
    for raw in raw_events:
        if type(raw) is dict and raw.get("type") == "BlockRemoved":
            hashes, where = raw.get("block_hashes"), (raw.get("medium"), raw.get("group_idx"))
        elif type(raw) is list and raw and raw[0] == "BlockRemoved":
            hashes = raw[1] if len(raw) > 1 else None
            where = (raw[2] if len(raw) > 2 else None, raw[3] if len(raw) > 3 else None)
        else:
            if run:
                events.append(_removed(run, run_where))
                run = []
            event = _event(raw)
            if event is None:
                unknown += 1
            else:
                events.append(event)
            continue
        if type(hashes) is not list or not hashes:
            raise DecodeError("block_hashes")
        if run and where != run_where:
            events.append(_removed(run, run_where))
            run = []
        run_where = where
        run.extend(hashes)
    if run:
        events.append(_removed(run, run_where))
    return events, unknown


def _removed(hashes: list[Any], where: tuple[Any, Any]) -> BlockRemoved:
    """One run's event; its medium and group are checked once per run, not per block."""
    return BlockRemoved(_hashes(hashes), _opt_str(where[0]), _opt_int(where[1]))


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        fields = dict(zip(_STORED_FIELDS, raw[1:], strict=False))
    else:
        raise DecodeError("event_shape")
    if kind == "BlockStored":
        if fields.get("block_size") == 0 and fields.get("token_ids") == []:
            return None  # an offloading connector's placeholder (no self-describing events): nothing to key
        return _stored(fields)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(kind, str):
        return None
    raise DecodeError("event_type")


def _stored(fields: dict[Any, Any]) -> BlockStored:
    return _stored_from(fields.get("block_hashes"), fields.get("block_size"), fields.get("token_ids"),
                        fields.get("parent_block_hash"), fields.get("extra_keys"), fields.get("lora_name"),
                        fields.get("medium"), fields.get("group_idx"))


def _stored_from(raw_hashes: Any, block_size: Any, tokens: Any, parent: Any, extra: Any, lora_name: Any,
                 medium: Any, group_idx: Any) -> BlockStored:
    hashes = _hashes(raw_hashes)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise DecodeError("block_size")
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * block_size or not _all_u32(tokens):
        raise DecodeError("token_ids")
    _check_extra(extra, len(hashes))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_name=_opt_str(lora_name),
        medium=_opt_str(medium),
        extra_keys=_frozen_extra(extra),
        group_idx=_opt_int(group_idx),
    )


def _check_extra(extra: Any, blocks: int) -> None:
    if extra is not None and (not isinstance(extra, list) or len(extra) != blocks):
        raise DecodeError("extra_keys")


def _frozen_extra(extra: list[Any] | None) -> tuple[Any, ...] | None:
    return None if extra is None or extra.count(None) == len(extra) else tuple(map(_freeze, extra))


def _hash(value: Any) -> int:
    try:
        return engine_hash_to_int(value)
    except ValueError as exc:
        raise DecodeError("block_hash") from exc


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise DecodeError("block_hashes")
    if len(value) == 1 and type(value[0]) is int and 0 <= value[0] <= U64_MASK:
        return (value[0] & KEY_MASK,)  # a decode event's one block: no set, min and max
    if set(map(type, value)) == _INT_ONLY and min(value) >= 0 and max(value) <= U64_MASK:
        return tuple([item & KEY_MASK for item in value])  # the u64 form vLLM sends by default, checked in C
    return tuple(_hash(item) for item in value)


_INT_ONLY = {int}


def _all_u32(values: list[Any]) -> bool:
    """Whether every value is a plain int in 0..2**32-1 (bools refused); the loops run in C: this check is
    on the path of every token of every stored block."""
    if not values:
        return True
    return set(map(type, values)) == _INT_ONLY and min(values) >= 0 and max(values) <= MAX_TOKEN_ID


def _opt_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DecodeError("field_type")


def _opt_int(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise DecodeError("field_type")


def _freeze(value: Any, depth: int = 0) -> Any:
    """msgpack gives lists for tuples; make extra keys hashable, refusing hostile nesting."""
    if isinstance(value, list):
        if depth >= _MAX_EXTRA_DEPTH:
            raise DecodeError("extra_keys")
        return tuple(_freeze(item, depth + 1) for item in value)
    if isinstance(value, dict):
        raise DecodeError("extra_keys")
    return value
