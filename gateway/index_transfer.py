"""State transfer of one engine's block index between replicas, so a starting replica is warm.

Every replica ingests every engine's KV events itself (gateway/event_ingest.py). A replica that starts
(or adds an engine) asks its peers for their index of that engine: the engine hashes and own keys it
holds, the last event seq applied per event source, and how far the peer's index lags the engine's stream.
It loads the best answer (the highest seqs, then the least lag) and resumes each source from its seq, so
the engine's replay buffer fills the gap between the peer's snapshot and the live stream, exactly as after
a reconnect; the engine's confidence stays reduced (by the peer's lag) until its own events confirm the
snapshot (index/freshness.py). Without an answer it starts cold and backfills from the replay buffer.

Blob: msgpack ``[FORMAT, seqs, hashes, own_keys, lag_s]``, one entry per event source in each of the lists
(a data-parallel engine has one source per rank, each with its own blocks: index/holders.py):
``seqs`` an int or nil, ``hashes`` and ``own_keys`` little-endian u64 arrays of equal length; ``lag_s`` a
finite number of seconds. The mesh sends it in 1 MiB chunks (mesh/sync_protocol.py). Everything from a
peer is checked: a blob that does not decode, has unequal arrays, hashes out of the index's range or more
blocks than the engine can hold is refused (counted by the caller), never half-loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from index.alias_table import storable
from index.mask_table import KEY_LIMIT

FORMAT = 3
NAMESPACE = "index"
MAX_SEQ = 2**63
MAX_LAG_S = 86400.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What a peer knows of one engine: its blocks and where each event source stood."""

    seqs: tuple[int | None, ...]
    hashes: tuple[np.ndarray, ...]
    own_keys: tuple[np.ndarray, ...]
    """Per event source, like ``seqs``."""
    lag_s: float = 0.0
    """How far the peer's index lagged the engine's stream when it answered."""

    @property
    def blocks(self) -> int:
        return sum(map(len, self.hashes))

    def progress(self) -> int:
        """How far the snapshot got (to pick the freshest answer): the sum of its known seqs."""
        return sum(s for s in self.seqs if s is not None)


def encode(seqs: list[int | None], hashes: list[np.ndarray], own_keys: list[np.ndarray], lag_s: float = 0.0) -> bytes:
    return msgpack.packb([FORMAT, seqs, [h.astype("<u8").tobytes() for h in hashes],
                          [k.astype("<u8").tobytes() for k in own_keys], float(lag_s)])


def _arrays(hashes: object, own_keys: object) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(hashes, bytes) and isinstance(own_keys, bytes)) or len(hashes) != len(own_keys) \
            or len(hashes) % 8:
        raise ValueError("index snapshot arrays of unequal or partial length")
    hash_array = np.frombuffer(hashes, dtype="<u8").astype(np.uint64)
    own_array = np.frombuffer(own_keys, dtype="<u8").astype(np.uint64)
    if len(hash_array) and not storable(int(hash_array.max()), 0):
        raise ValueError("index snapshot hash out of range")
    if len(own_array) and int(own_array.max()) >= KEY_LIMIT:
        raise ValueError("index snapshot own key out of range")
    return hash_array, own_array


def decode(blob: bytes, sources: int) -> EngineSnapshot:
    """Raises ValueError unless ``blob`` is a well-formed snapshot for an engine with ``sources`` sources."""
    try:
        version, seqs, hashes, own_keys, lag_s = msgpack.unpackb(blob, max_bin_len=len(blob), max_array_len=4096)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"undecodable index snapshot: {exc!r}") from None
    if version != FORMAT or not all(isinstance(x, list) and len(x) == sources for x in (seqs, hashes, own_keys)):
        raise ValueError("index snapshot of another format or source count")
    if not all(s is None or (isinstance(s, int) and 0 <= s < MAX_SEQ) for s in seqs):
        raise ValueError("index snapshot seq out of range")
    if not isinstance(lag_s, float | int) or isinstance(lag_s, bool) or not 0 <= lag_s <= MAX_LAG_S:
        raise ValueError("index snapshot lag out of range")
    arrays = [_arrays(h, k) for h, k in zip(hashes, own_keys, strict=True)]
    return EngineSnapshot(tuple(seqs), tuple(a[0] for a in arrays), tuple(a[1] for a in arrays), float(lag_s))


def best(answers: list[EngineSnapshot]) -> EngineSnapshot | None:
    """The answer that got furthest; ties go to the least lag, then to the larger index."""
    return max(answers, key=lambda s: (s.progress(), -s.lag_s, s.blocks), default=None)
