"""ZeroMQ CURVE for KV-event channels: the router proves who it is to a publisher and checks the publisher.

Without it, anyone who can reach an engine's event port can read its block hashes, and anyone who can
stand in for the engine's address can publish blocks for it. vLLM's publisher has no CURVE option today;
a CURVE-enabled forwarder next to the engine (a ZeroMQ proxy whose XPUB/ROUTER sockets are CURVE servers,
connected to the engine's local PUB/ROUTER), or a patched publisher, closes the channel. The router then
needs the publisher's public key (``[[engines]] curve_server_key``) and its own key pair (the secret in
``events_curve_secret_file``; the public half is derived from it). Keys are Z85 text, 40 characters, as
``zmq.curve_keypair()`` and ``kvmesh keys curve`` make them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

Z85_KEY_CHARS = 40


def check_z85_key(value: str, what: str) -> bytes:
    """The key as bytes; ValueError naming ``what`` if it is not a 40-character Z85 CURVE key."""
    if not isinstance(value, str) or len(value) != Z85_KEY_CHARS or not value.isascii():
        raise ValueError(f"{what}: expected a 40-character Z85 CURVE key")
    try:
        z85.decode(value)
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"{what}: expected a 40-character Z85 CURVE key") from None
    return value.encode("ascii")


@dataclass(frozen=True)
class CurveClient:
    """The router's own CURVE key pair, used on every SUB and replay socket that names a server key."""

    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def load(cls, secret_file: str) -> CurveClient:
        """Read the secret key (Z85, first line) and derive the public one; ValueError says what is wrong."""
        try:
            text = Path(secret_file).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the CURVE secret key file: {exc.__class__.__name__}") from None
        secret = check_z85_key(text, "the CURVE secret key file")
        return cls(zmq.curve_public(secret), secret)

    def secure(self, sock: zmq.Socket, server_key: str) -> None:
        """Make ``sock`` a CURVE client of the publisher whose public key is ``server_key`` (before connect)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
