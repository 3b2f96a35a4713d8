"""Authenticated framing for every mesh message (gossip over UDP, replication over TCP).

Sans-IO: callers hand in the wall-clock time, so the replay window is testable without sleeping.

Packet layout::

    version (1 byte) | kind (1 byte) | body | HMAC-SHA256 (32 bytes)
    body = msgpack [sender_id: str, timestamp: float, nonce: bytes, payload: any, (recipient: str)]

The MAC covers a per-transport *domain* (so a gossip packet can never be replayed into the
replication stream), the version, the kind byte and the body. A packet is accepted only if the MAC
matches, its timestamp is a finite number within ``max_skew`` of the receiver's clock, its (sender,
nonce) pair was not seen before, and, when it names a recipient, the recipient is this process (a
packet captured on its way to A does not verify at B). ``require_recipient`` refuses packets that
name none; it can be switched on once every sender passes ``recipient`` to :meth:`MeshAuth.seal`.
Every rejection raises :class:`AuthError`, is counted per reason on the instance and in the
Prometheus counter ``kvmesh_mesh_auth_failures_total``.

Stream transports (TCP) wrap packets with :func:`frame` and split them with :class:`FrameReader`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from prometheus_client import Counter as PromCounter

VERSION = 1
MAC_SIZE = 32
NONCE_SIZE = 12
HEADER_SIZE = 2
MIN_SECRET_BYTES = 16
DEFAULT_MAX_SKEW = 15.0
DEFAULT_REPLAY_CAPACITY = 200_000
MAX_PACKET_BYTES = 16 * 1024 * 1024
_LENGTH = struct.Struct(">I")

AUTH_FAILURES = PromCounter(
    "kvmesh_mesh_auth_failures_total",
    "Mesh packets dropped because they failed authentication",
    ["domain", "reason"],
)


class AuthError(Exception):
    """A packet failed authentication; ``reason`` is a short label (mac, skew, replay, ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Envelope:
    """An authenticated message: who sent it, when, which kind, and the decoded payload."""

    kind: int
    sender_id: str
    timestamp: float
    payload: Any


PUBLIC_EXAMPLE_SECRETS = frozenset({
    b"replace this file with 64 random hex characters before exposing the mesh ports",
})
"""Secrets that were published (an example file once shipped with this one): knowing it is knowing nothing."""


class MeshSecret(bytes):
    """The cluster secret: bytes whose repr and str never show the value, so settings, configs and
    tracebacks that hold it can be printed and logged."""

    def __repr__(self) -> str:
        return f"MeshSecret(<{len(self)} bytes hidden>)"

    __str__ = __repr__


def load_secret(path: str | os.PathLike[str]) -> MeshSecret:
    """Read a cluster secret file; surrounding whitespace is ignored so `echo secret > f` works."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"mesh secret in {path} must be at least {MIN_SECRET_BYTES} bytes")
    if secret in PUBLIC_EXAMPLE_SECRETS:
        raise ValueError(f"mesh secret in {path} is a published example; generate one, e.g. "
                         "python3 -c 'import secrets; print(secrets.token_hex(32))'")
    return MeshSecret(secret)


def record_mac(secret: bytes, domain: bytes, parts: Iterable[bytes]) -> bytes:
    """HMAC-SHA256 of a stored record (a Redis snapshot, a seed entry) under the mesh secret.

    The message is the domain, then each part, all length-prefixed, so no two different records (or
    uses: every use has its own domain, e.g. ``b"kvmesh-snapshot-v1"``) share a message.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"mesh secret must be at least {MIN_SECRET_BYTES} bytes")
    mac = hmac.new(secret, _LENGTH.pack(len(domain)) + domain, hashlib.sha256)
    for part in parts:
        mac.update(_LENGTH.pack(len(part)))
        mac.update(part)
    return mac.digest()


def record_mac_ok(secret: bytes, domain: bytes, parts: Iterable[bytes], mac: bytes) -> bool:
    """Whether ``mac`` seals ``parts`` under ``domain`` (constant-time comparison)."""
    return hmac.compare_digest(record_mac(secret, domain, parts), mac)


class MeshAuth:
    """Seals and opens packets for one transport domain with the shared cluster secret.

    One instance per process and domain: it holds the replay cache of the packets it accepted.
    """

    def __init__(
        self,
        secret: bytes,
        sender_id: str,
        *,
        domain: str,
        max_skew: float = DEFAULT_MAX_SKEW,
        replay_capacity: int = DEFAULT_REPLAY_CAPACITY,
        random_bytes: Callable[[int], bytes] = os.urandom,
        local_names: Iterable[str] = (),
        require_recipient: bool = False,
    ) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"mesh secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = secret
        self._domain = domain
        self._prefix = struct.pack(">H", len(domain.encode())) + domain.encode()
        self.sender_id = sender_id
        self.local_names = {sender_id, *local_names}
        """What senders may name as this process's recipient: its id and the addresses it is dialled at."""
        self.require_recipient = require_recipient
        self.max_skew = max_skew
        self._replay_capacity = replay_capacity
        self._random_bytes = random_bytes
        # (sender, nonce) -> timestamp, in arrival order; entries older than the skew window are useless.
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        # Timestamps at or below this floor are refused: their nonces may have been evicted.
        self._floor = float("-inf")
        self.failures: Counter[str] = Counter()
        self.accepted = 0

    def _mac(self, header_and_body: bytes) -> bytes:
        return hmac.new(self._key, self._prefix + header_and_body, hashlib.sha256).digest()

    def seal(self, kind: int, payload: Any, now: float, recipient: str | None = None) -> bytes:
        """Encode and sign ``payload`` as a message of ``kind`` (0..255) sent at wall time ``now``, for
        ``recipient`` (its member id, or the address it is dialled at) when given."""
        if not 0 <= kind <= 255:
            raise ValueError("kind must fit in one byte")
        fields = [self.sender_id, float(now), self._random_bytes(NONCE_SIZE), payload]
        if recipient is not None:
            fields.append(recipient)
        body = msgpack.packb(fields, use_bin_type=True)
        signed = bytes((VERSION, kind)) + body
        return signed + self._mac(signed)

    def open(self, packet: bytes, now: float) -> Envelope:
        """Verify ``packet`` received at wall time ``now``; raise :class:`AuthError` if it must be dropped."""
        try:
            return self._open(packet, now)
        except AuthError as exc:
            self.failures[exc.reason] += 1
            AUTH_FAILURES.labels(self._domain, exc.reason).inc()
            raise

    def _open(self, packet: bytes, now: float) -> Envelope:
        if len(packet) < HEADER_SIZE + MAC_SIZE + 1:
            raise AuthError("short")
        if len(packet) > MAX_PACKET_BYTES:
            raise AuthError("oversize")
        signed, mac = packet[:-MAC_SIZE], packet[-MAC_SIZE:]
        if not hmac.compare_digest(self._mac(signed), mac):
            raise AuthError("mac")
        if signed[0] != VERSION:
            raise AuthError("version")
        sender_id, timestamp, nonce, payload, recipient = _decode_body(signed[HEADER_SIZE:])
        if not (math.isfinite(timestamp) and abs(now - timestamp) <= self.max_skew):
            raise AuthError("skew")
        if recipient not in self.local_names and (recipient is not None or self.require_recipient):
            raise AuthError("recipient")
        if timestamp <= self._floor or (sender_id, nonce) in self._seen:
            raise AuthError("replay")
        self._remember(sender_id, nonce, timestamp, now)
        self.accepted += 1
        return Envelope(signed[1], sender_id, timestamp, payload)

    def _remember(self, sender_id: str, nonce: bytes, timestamp: float, now: float) -> None:
        self._seen[(sender_id, nonce)] = timestamp
        horizon = now - self.max_skew
        while self._seen:
            key, ts = next(iter(self._seen.items()))
            if ts >= horizon and len(self._seen) <= self._replay_capacity:
                break
            del self._seen[key]
            if ts >= horizon:
                self._floor = max(self._floor, ts)


def _decode_body(body: bytes) -> tuple[str, float, bytes, Any, str | None]:
    """Decode an authenticated body; only a peer holding the secret can reach this, still never trust it."""
    try:
        decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise AuthError("malformed") from exc
    if not (isinstance(decoded, list) and len(decoded) in (4, 5)):
        raise AuthError("malformed")
    sender_id, timestamp, nonce, payload, *rest = decoded
    recipient = rest[0] if rest else None
    if not (
        isinstance(sender_id, str)
        and isinstance(timestamp, float)
        and isinstance(nonce, bytes)
        and isinstance(recipient, str | None)
        and (not rest or recipient is not None)
    ):
        raise AuthError("malformed")
    return sender_id, timestamp, nonce, payload, recipient


def frame(packet: bytes) -> bytes:
    """Length-prefix a sealed packet for a byte stream (TCP)."""
    return _LENGTH.pack(len(packet)) + packet


class FrameError(Exception):
    """The byte stream announced a frame larger than allowed: the connection must be closed."""


class FrameReader:
    """Splits a byte stream into length-prefixed packets (sans-IO: feed bytes, get packets)."""

    def __init__(self, max_frame: int = MAX_PACKET_BYTES, first_frame_max: int | None = None) -> None:
        """``first_frame_max``: a smaller limit for the first frame, so a peer that has not yet sent an
        authenticated frame cannot make the reader buffer a large one."""
        self._buffer = bytearray()
        self._max_frame = max_frame
        self._limit = max_frame if first_frame_max is None else first_frame_max

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every complete packet now available, in order."""
        self._buffer += data
        packets: list[bytes] = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size > self._limit:
                raise FrameError(f"frame of {size} bytes exceeds {self._limit}")
            end = _LENGTH.size + size
            if len(self._buffer) < end:
                break
            packets.append(bytes(self._buffer[_LENGTH.size : end]))
            del self._buffer[:end]
            self._limit = self._max_frame
        return packets
