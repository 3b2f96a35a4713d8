"""Replication protocol between replicas (sans-IO): frames in, frames out, time passed in.

Every frame is a msgpack array ``[kind, epoch number, epoch owner, sender, *payload]``:

- ``u``  ``[update]``           incremental update (the batched broadcast, or an anti-entropy answer)
- ``sv`` ``[state]``            anti-entropy request: "here is what I have"
- ``sd`` ``[diff, state]``      answer to ``sv``: what the requester lacks, plus my own state
- ``ep`` ``[base epoch, base, full]``  a whole epoch: full state plus the epoch and state vector it was
                                built from
- ``ld`` ``[report]``           the sender's in-flight requests per engine (mesh/peer_load.py); outside the
                                document, so accepted whatever the epoch
- ``sq`` ``[request]``          state-transfer query: "send me your state of (namespace, key)"
- ``sc`` ``[chunk header, chunk]``  one chunk of the answer; ``count`` 0 means "I hold nothing"

State transfer carries what is too big or too hot for the document (a replica's block index of one
engine) from a peer that has it to one that starts: the provider registered for the namespace turns a
key into one blob, which travels in chunks of at most ``STATE_CHUNK_BYTES`` so no frame nears the
transport's limit however large the state grows. ``sq``/``sc`` are outside the document's epochs too.

A frame from an older epoch is answered with ``ep`` (rate-limited per peer); a non-``ep`` frame from a
newer epoch is answered with ``sv`` so that the peer sends its ``ep``. Malformed frames are counted and
dropped; nothing here raises on peer input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgpack

from mesh import peer_load
from mesh.crdt_doc import Epoch, ReplicatedDoc, decode_state, encode_state
from mesh.peer_load import PeerLoad

EPOCH_RESEND_S = 1.0
MAX_EPOCH_SENT = 1024
STATE_CHUNK_BYTES = 1 << 20
MAX_STATE_CHUNKS = 4096
"""At most 4 GiB of state per answer; a header claiming more is malformed."""

StateProvider = Callable[[str], bytes | None]
"""key -> this replica's state blob for it, or None when it holds nothing worth sending."""


class SyncProtocol:
    """Turns received frames into document changes and reply frames for one replica."""

    def __init__(self, doc: ReplicatedDoc, epoch_resend_s: float = EPOCH_RESEND_S) -> None:
        self.doc = doc
        self.counters: Counter[str] = Counter()
        self.peer_load = PeerLoad()
        self.transfers = StateTransfers()
        self._providers: dict[str, StateProvider] = {}
        self._epoch_resend_s = epoch_resend_s
        self._epoch_sent: dict[str, tuple[Epoch, float]] = {}
        self._handlers: dict[str, Callable[[str, list], list[bytes]]] = {
            "u": self._on_update,
            "sv": self._on_state,
            "sd": self._on_state_diff,
        }

    def _frame(self, kind: str, *payload: object) -> bytes:
        return msgpack.packb([kind, self.doc.epoch.number, self.doc.epoch.owner, self.doc.replica_id, *payload])

    def update_frame(self) -> bytes | None:
        """The batched local updates since the last call, as one ``u`` frame (None if nothing new)."""
        update = self.doc.take_update()
        return None if update is None else self._frame("u", update)

    def load_frame(self, loads: dict[str, int]) -> bytes:
        return self._frame("ld", peer_load.encode(loads))

    def state_frame(self) -> bytes:
        """An anti-entropy request (also sent on every new connection so a joining replica warms up)."""
        return self._frame("sv", self.doc.state())

    def epoch_frame(self) -> bytes:
        base_epoch = msgpack.packb([self.doc.base_epoch.number, self.doc.base_epoch.owner])
        return self._frame("ep", base_epoch, encode_state(self.doc.base_state), self.doc.full_update())

    def serve_state(self, namespace: str, provider: StateProvider) -> None:
        """Answer peers' state queries for ``namespace`` with ``provider``."""
        self._providers[namespace] = provider

    def state_query_frame(self, namespace: str, key: str) -> tuple[int, bytes]:
        """A query to send to peers, with the request id their answers will carry."""
        request_id = self.transfers.open(namespace, key)
        return request_id, self._frame("sq", msgpack.packb([namespace, key, request_id]))

    def maybe_compact(self, is_compactor: bool, min_churn: int = 50_000, ratio: float = 1.0) -> bytes | None:
        """Compact if this replica is the designated compactor and tombstones outweigh live keys;
        returns the ``ep`` frame to broadcast."""
        if not (is_compactor and self.doc.needs_compaction(min_churn, ratio)):
            return None
        self.doc.compact()
        self.counters["compactions"] += 1
        return self.epoch_frame()

    def load_snapshot(self, epoch: Epoch, base_epoch: Epoch, base: dict[int, int], full: bytes) -> bool:
        """Start from a stored snapshot: adopt it if newer, merge it if same epoch, ignore if older."""
        try:
            if epoch > self.doc.epoch:
                self.doc.adopt(epoch, base_epoch, base, full)
            elif epoch == self.doc.epoch:
                self.doc.apply_update(full)
            else:
                return False
        except ValueError:
            self.counters["malformed_snapshot"] += 1
            return False
        return True

    def on_frame(self, data: bytes, now: float) -> list[bytes]:
        """Handle one frame from a peer; returns the frames to send back to that peer."""
        try:
            message = msgpack.unpackb(data)
            kind, number, owner, sender, *payload = message
            if not (isinstance(kind, str) and isinstance(number, int) and isinstance(owner, str)
                    and isinstance(sender, str) and all(isinstance(p, bytes) for p in payload)):
                raise ValueError("bad frame header")
            return self._dispatch(kind, Epoch(number, owner), sender, payload, now)
        except (ValueError, TypeError, OverflowError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.counters["malformed"] += 1
            return []

    def _dispatch(self, kind: str, epoch: Epoch, sender: str, payload: list, now: float) -> list[bytes]:
        if kind == "ld":
            (report,) = payload
            self.peer_load.update(sender, report, now)
            self.counters["rx_ld"] += 1
            return []
        if kind == "sq":
            (query,) = payload
            return self._answer_state(*_state_query(query))
        if kind == "sc":
            header, chunk = payload
            self.transfers.on_chunk(sender, *_chunk_header(header), chunk)
            self.counters["rx_sc"] += 1
            return []
        mine = self.doc.epoch
        if kind == "ep":
            packed_base_epoch, base, full = payload
            number, owner = msgpack.unpackb(packed_base_epoch)
            if not (isinstance(number, int) and isinstance(owner, str)):
                raise ValueError("bad base epoch")
            if epoch < mine:
                return self._epoch_reply(sender, now)
            if self.load_snapshot(epoch, Epoch(number, owner), decode_state(base), full):
                self.counters["epochs_adopted" if epoch > mine else "epochs_merged"] += 1
            return []
        if epoch < mine:
            self.counters["stale_epoch"] += 1
            return self._epoch_reply(sender, now)
        if epoch > mine:
            self.counters["newer_epoch"] += 1
            return [self.state_frame()]
        handler = self._handlers.get(kind)
        if handler is None:
            raise ValueError(f"unknown frame kind {kind!r}")
        self.counters[f"rx_{kind}"] += 1
        return handler(sender, payload)

    def _epoch_reply(self, sender: str, now: float) -> list[bytes]:
        last = self._epoch_sent.get(sender)
        if last is not None and last[0] == self.doc.epoch and now - last[1] < self._epoch_resend_s:
            return []
        if len(self._epoch_sent) >= MAX_EPOCH_SENT:  # ids are new at every start: forget the long gone
            self._epoch_sent = {p: v for p, v in self._epoch_sent.items() if now - v[1] < self._epoch_resend_s}
        self._epoch_sent[sender] = (self.doc.epoch, now)
        return [self.epoch_frame()]

    def _answer_state(self, namespace: str, key: str, request_id: int) -> list[bytes]:
        provider = self._providers.get(namespace)
        blob = provider(key) if provider is not None else None
        self.counters["state_queries"] += 1
        if not blob:
            return [self._frame("sc", msgpack.packb([namespace, key, request_id, 0, 0]), b"")]
        chunks = [blob[i : i + STATE_CHUNK_BYTES] for i in range(0, len(blob), STATE_CHUNK_BYTES)]
        if len(chunks) > MAX_STATE_CHUNKS:
            self.counters["state_too_large"] += 1
            return [self._frame("sc", msgpack.packb([namespace, key, request_id, 0, 0]), b"")]
        self.counters["state_chunks_sent"] += len(chunks)
        return [self._frame("sc", msgpack.packb([namespace, key, request_id, i, len(chunks)]), chunk)
                for i, chunk in enumerate(chunks)]

    def _on_update(self, _sender: str, payload: list) -> list[bytes]:
        (update,) = payload
        self.doc.apply_update(update)
        return []

    def _on_state(self, _sender: str, payload: list) -> list[bytes]:
        (state,) = payload
        return [self._frame("sd", self.doc.diff(state), self.doc.state())]

    def _on_state_diff(self, _sender: str, payload: list) -> list[bytes]:
        diff, state = payload
        self.doc.apply_update(diff)
        return [self._frame("u", self.doc.diff(state))]


def _state_query(packed: bytes) -> tuple[str, str, int]:
    namespace, key, request_id = msgpack.unpackb(packed)
    if not (isinstance(namespace, str) and isinstance(key, str) and isinstance(request_id, int)):
        raise ValueError("bad state query")
    return namespace, key, request_id


def _chunk_header(packed: bytes) -> tuple[str, str, int, int, int]:
    namespace, key, request_id, index, count = msgpack.unpackb(packed)
    if not (isinstance(namespace, str) and isinstance(key, str)
            and all(isinstance(n, int) for n in (request_id, index, count))
            and 0 <= count <= MAX_STATE_CHUNKS and (count == 0 or 0 <= index < count)):
        raise ValueError("bad state chunk header")
    return namespace, key, request_id, index, count


class StateTransfers:
    """Open state queries and the chunks answering them, per answering peer (sans-IO).

    An answer is complete when every chunk arrived; chunks of unknown queries, of another namespace or
    key than asked, or beyond the announced count are counted and dropped."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._next_id = 1
        self._open: dict[int, tuple[str, str]] = {}
        self._parts: dict[int, dict[str, dict[int, bytes]]] = {}
        self._counts: dict[int, dict[str, int]] = {}

    def open(self, namespace: str, key: str) -> int:
        request_id = self._next_id
        self._next_id += 1
        self._open[request_id] = (namespace, key)
        self._parts[request_id] = {}
        self._counts[request_id] = {}
        return request_id

    def on_chunk(self, sender: str, namespace: str, key: str, request_id: int, index: int, count: int,
                 chunk: bytes) -> None:
        if self._open.get(request_id) != (namespace, key):
            self.counters["unexpected_chunk"] += 1
            return
        counts = self._counts[request_id]
        if counts.setdefault(sender, count) != count:
            self.counters["inconsistent_chunk"] += 1
            return
        if count:
            self._parts[request_id].setdefault(sender, {})[index] = chunk

    def answers(self, request_id: int) -> dict[str, bytes | None]:
        """Complete answers so far, per peer: the joined blob, or None for "holds nothing"."""
        result: dict[str, bytes | None] = {}
        parts = self._parts.get(request_id, {})
        for sender, count in self._counts.get(request_id, {}).items():
            if count == 0:
                result[sender] = None
            elif len(chunks := parts.get(sender, {})) == count:
                result[sender] = b"".join(chunks[i] for i in range(count))
        return result

    def close(self, request_id: int) -> None:
        self._open.pop(request_id, None)
        self._parts.pop(request_id, None)
        self._counts.pop(request_id, None)
