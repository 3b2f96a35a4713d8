"""``kvmesh keys``: hashing from an argument or stdin (never echoed) and generating new keys."""

import hashlib
import io

import pytest

from gateway.security.config import is_hashed_key
from gateway.security.keys import generate_key, hash_key, main


def test_hash_key_is_sha256_of_the_ascii_key():
    assert hash_key("kvm-abc") == "sha256:" + hashlib.sha256(b"kvm-abc").hexdigest()
    assert is_hashed_key(hash_key("x"))


@pytest.mark.parametrize("key", ["kvm-é", "kvm-\u2603", "kvm-a b", "kvm-\x7f", ""])
def test_hash_key_refuses_keys_no_request_header_could_carry(key):
    """Headers are decoded as latin-1: the UTF-8 hash of a non-ASCII key would never match a request."""
    with pytest.raises(ValueError, match="visible ASCII|empty"):
        hash_key(key)


def test_hash_from_argument(capsys):
    assert main(["hash", "kvm-abc"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("kvm-abc")


def test_hash_from_stdin_does_not_echo_the_key(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("kvm-from-stdin\n"))
    assert main(["hash"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == hash_key("kvm-from-stdin")
    assert "kvm-from-stdin" not in captured.out + captured.err


def test_empty_stdin_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["hash"]) == 2
    assert capsys.readouterr().out == ""


def test_generate_prints_a_fresh_key_and_its_hash(capsys):
    assert main(["generate"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert lines["hash"].strip() == hash_key(lines["key"].strip())
    assert generate_key() != generate_key() and len(generate_key()) > 40


def test_keys_that_could_never_authenticate_are_refused(capsys):
    """Headers are read as latin-1 and a bearer token ends at whitespace: such a key's hash never matches."""
    for key in ("kvm-é", "kvm-a b", "kvm-\x01", "kvm-\u2603"):
        assert main(["hash", key]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "visible ASCII" in captured.err and key not in captured.err
