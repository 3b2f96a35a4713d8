"""Authentication of mesh packets: tampering, wrong secrets, replay and clock skew are all refused."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.auth import AUTH_FAILURES, AuthError, FrameError, FrameReader, MeshAuth, frame, load_secret

SECRET = b"correct horse battery staple"


def make(sender: str = "a", secret: bytes = SECRET, domain: str = "gossip", **kw) -> MeshAuth:
    return MeshAuth(secret, sender, domain=domain, **kw)


def test_round_trip_carries_kind_sender_and_payload():
    packet = make("alice").seal(7, {"k": [1, 2, b"x"]}, now=100.0)
    env = make("bob").open(packet, now=100.5)
    assert (env.kind, env.sender_id, env.timestamp, env.payload) == (7, "alice", 100.0, {"k": [1, 2, b"x"]})


@given(st.data())
def test_any_single_byte_change_is_rejected(data):
    packet = make().seal(3, {"x": 1}, now=10.0)
    index = data.draw(st.integers(0, len(packet) - 1))
    flip = data.draw(st.integers(1, 255))
    tampered = packet[:index] + bytes([packet[index] ^ flip]) + packet[index + 1 :]
    receiver = make("b")
    with pytest.raises(AuthError) as exc:
        receiver.open(tampered, now=10.0)
    assert exc.value.reason == "mac"
    assert receiver.failures["mac"] == 1


@given(st.binary(max_size=200))
def test_garbage_never_crashes_and_is_counted(blob):
    receiver = make("b")
    with pytest.raises(AuthError):
        receiver.open(blob, now=0.0)
    assert sum(receiver.failures.values()) == 1


def test_wrong_secret_is_counted_in_prometheus():
    before = AUTH_FAILURES.labels("gossip", "mac")._value.get()
    packet = make(secret=b"another secret of 16+ bytes").seal(1, None, now=0.0)
    with pytest.raises(AuthError):
        make("b").open(packet, now=0.0)
    assert AUTH_FAILURES.labels("gossip", "mac")._value.get() == before + 1


def test_other_domain_packet_is_rejected():
    packet = make(domain="replication").seal(1, {}, now=0.0)
    with pytest.raises(AuthError, match="mac"):
        make("b", domain="gossip").open(packet, now=0.0)


def test_replayed_packet_is_rejected_once_accepted():
    packet = make().seal(1, "hi", now=50.0)
    receiver = make("b")
    receiver.open(packet, now=50.0)
    with pytest.raises(AuthError, match="replay"):
        receiver.open(packet, now=51.0)


def test_old_or_future_packets_are_rejected():
    receiver = make("b", max_skew=5.0)
    with pytest.raises(AuthError, match="skew"):
        receiver.open(make().seal(1, 0, now=0.0), now=5.5)
    with pytest.raises(AuthError, match="skew"):
        receiver.open(make().seal(1, 0, now=10.0), now=4.0)


def test_replay_cache_is_bounded_and_refuses_evicted_range():
    receiver = make("b", replay_capacity=10)
    sender = make()
    packets = [sender.seal(1, i, now=100.0 + i * 0.01) for i in range(30)]
    for p in packets:
        receiver.open(p, now=101.0)
    assert len(receiver._seen) <= 10
    for p in packets:
        with pytest.raises(AuthError, match="replay"):
            receiver.open(p, now=101.0)


def test_signed_but_malformed_body_is_rejected():
    auth = make()
    signed = bytes((1, 1)) + msgpack.packb({"not": "a list"})
    with pytest.raises(AuthError, match="malformed"):
        auth.open(signed + auth._mac(signed), now=0.0)


@given(st.lists(st.binary(max_size=50), max_size=20), st.integers(1, 7))
def test_frame_reader_splits_any_chunking(packets, chunk):
    stream = b"".join(frame(p) for p in packets)
    reader = FrameReader()
    out = []
    for i in range(0, len(stream), chunk):
        out += reader.feed(stream[i : i + chunk])
    assert out == packets


def test_frame_reader_refuses_oversized_frame():
    with pytest.raises(FrameError):
        FrameReader(max_frame=100).feed(frame(b"x" * 101))


def test_load_secret_strips_and_requires_length(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(path) == SECRET
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError):
        load_secret(path)
