"""Mesh auth edges: a packet names its recipient and verifies nowhere else, a timestamp that is not a finite
number fails the skew check, the secret never shows in a repr, and the published example secret is refused."""

from __future__ import annotations

import math

import pytest

from mesh.auth import PUBLIC_EXAMPLE_SECRETS, AuthError, MeshAuth, load_secret
from mesh.settings import MeshSettings

SECRET = b"correct horse battery staple"


def auth(me: str, **kw) -> MeshAuth:
    return MeshAuth(SECRET, me, domain="gossip", **kw)


def refusal(receiver: MeshAuth, packet: bytes, now: float = 100.0) -> str:
    with pytest.raises(AuthError) as info:
        receiver.open(packet, now)
    return info.value.reason


def test_a_packet_for_a_verifies_at_a_and_not_at_b():
    packet = auth("s").seal(1, {"x": 1}, 100.0, recipient="A")
    assert auth("A").open(packet, 100.0).payload == {"x": 1}
    assert refusal(auth("B"), packet) == "recipient"
    by_address = auth("s").seal(1, {}, 100.0, recipient="10.0.0.2:7946")
    assert auth("B", local_names=["10.0.0.2:7946"]).open(by_address, 100.0).sender_id == "s"


def test_requiring_a_recipient_refuses_packets_that_name_none():
    unnamed = auth("s").seal(1, {}, 100.0)
    assert auth("A").open(unnamed, 100.0).sender_id == "s"
    assert refusal(auth("A", require_recipient=True), unnamed) == "recipient"


@pytest.mark.parametrize("stamp", [math.nan, math.inf, -math.inf])
def test_a_timestamp_that_is_not_a_finite_number_fails_the_skew_check(stamp):
    assert refusal(auth("A"), auth("s").seal(1, {}, stamp)) == "skew"


def test_the_secret_never_shows_in_a_repr(tmp_path):
    path = tmp_path / "mesh.secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    secret = load_secret(path)
    assert secret == b"0123456789abcdef0123456789abcdef"
    for holder in (secret, MeshSettings(secret=secret)):
        assert "0123456789abcdef" not in repr(holder) and "0123456789abcdef" not in str(holder)
    packet = MeshAuth(secret, "s", domain="gossip").seal(1, {"ok": True}, 1.0)
    assert MeshAuth(bytes(secret), "r", domain="gossip").open(packet, 1.0).payload == {"ok": True}


def test_the_published_example_secret_is_refused(tmp_path):
    path = tmp_path / "mesh.secret"
    path.write_bytes(next(iter(PUBLIC_EXAMPLE_SECRETS)) + b"\n")
    with pytest.raises(ValueError, match="published example"):
        load_secret(path)
