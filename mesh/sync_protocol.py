"""Replication protocol between replicas (sans-IO): frames in, frames out, time passed in.

Every frame is a msgpack array ``[kind, epoch number, epoch owner, sender, *payload]``:

- ``u``  ``[update]``           incremental update (the batched broadcast, or an anti-entropy answer)
- ``sv`` ``[state]``            anti-entropy request: "here is what I have"
- ``sd`` ``[diff, state]``      answer to ``sv``: what the requester lacks, plus my own state
- ``ep`` ``[base, full]``       a whole epoch: full state plus the base state vector it was built from
- ``ld`` ``[report]``           the sender's in-flight requests per engine (mesh/peer_load.py); outside the
                                document, so accepted whatever the epoch

A frame from an older epoch is answered with ``ep`` (rate-limited per peer); a non-``ep`` frame from a
newer epoch is answered with ``sv`` so that the peer sends its ``ep``. Malformed frames are counted and
dropped; nothing here raises on peer input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgpack

from mesh import peer_load
from mesh.crdt_doc import Epoch, IndexDoc, decode_state, encode_state
from mesh.peer_load import PeerLoad

EPOCH_RESEND_S = 1.0


class SyncProtocol:
    """Turns received frames into document changes and reply frames for one replica."""

    def __init__(self, doc: IndexDoc, epoch_resend_s: float = EPOCH_RESEND_S) -> None:
        self.doc = doc
        self.counters: Counter[str] = Counter()
        self.peer_load = PeerLoad()
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
        return self._frame("ep", encode_state(self.doc.base_state), self.doc.full_update())

    def maybe_compact(self, is_compactor: bool, min_churn: int = 50_000, ratio: float = 1.0) -> bytes | None:
        """Compact if this replica is the designated compactor and tombstones outweigh live keys;
        returns the ``ep`` frame to broadcast."""
        if not (is_compactor and self.doc.needs_compaction(min_churn, ratio)):
            return None
        self.doc.compact()
        self.counters["compactions"] += 1
        return self.epoch_frame()

    def load_snapshot(self, epoch: Epoch, base: dict[int, int], full: bytes) -> bool:
        """Start from a stored snapshot: adopt it if newer, merge it if same epoch, ignore if older."""
        try:
            if epoch > self.doc.epoch:
                self.doc.adopt(epoch, base, full)
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
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.counters["malformed"] += 1
            return []

    def _dispatch(self, kind: str, epoch: Epoch, sender: str, payload: list, now: float) -> list[bytes]:
        if kind == "ld":
            (report,) = payload
            self.peer_load.update(sender, report, now)
            self.counters["rx_ld"] += 1
            return []
        mine = self.doc.epoch
        if kind == "ep":
            base, full = payload
            if epoch < mine:
                return self._epoch_reply(sender, now)
            if self.load_snapshot(epoch, decode_state(base), full):
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
        self._epoch_sent[sender] = (self.doc.epoch, now)
        return [self.epoch_frame()]

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
