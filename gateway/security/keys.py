"""API key hashing and the ``kvmesh keys`` helper.

Keys are random high-entropy tokens, so a plain sha256 is enough to make a leaked config useless (no
slow KDF needed), and it lets the router look a presented key up by its hash in constant time.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import secrets
import sys

import zmq

KEY_PREFIX = "kvm-"


def key_problem(raw: str) -> str | None:
    """Why a key could never authenticate, or None. Request headers arrive as bytes read as latin-1 and a
    bearer token ends at whitespace, so only visible ASCII hashes the same on both sides."""
    if not raw:
        return "empty key"
    if not all("!" <= c <= "~" for c in raw):
        return "keys must be visible ASCII (no spaces, control or non-ASCII characters)"
    return None


def hash_key(raw: str) -> str:
    """The config form of a key; ValueError for a key that could never authenticate (see ``key_problem``),
    so no caller (the CLI, a benchmark writing a config) can store a hash no request will ever match."""
    problem = key_problem(raw)
    if problem is not None:
        raise ValueError(problem)
    return "sha256:" + hashlib.sha256(raw.encode("ascii")).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _read_key() -> str:
    """From stdin without echoing it: a terminal gets a hidden prompt, a pipe is read as is."""
    if sys.stdin.isatty():
        return getpass.getpass("API key: ")
    return sys.stdin.readline().rstrip("\r\n")


def main(argv: list[str] | None = None) -> int:
    """``kvmesh keys hash [KEY]`` prints a key's config form; ``kvmesh keys generate`` makes a new key;
    ``kvmesh keys curve`` a CURVE key pair (the secret goes in a file, the public key to the other side)."""
    parser = argparse.ArgumentParser(prog="kvmesh keys", description="API key helpers")
    sub = parser.add_subparsers(dest="command", required=True)
    hashing = sub.add_parser("hash", help="print sha256:<hex> for a key (read from stdin if not given)")
    hashing.add_argument("key", nargs="?", help="the key; prefer stdin, arguments land in shell history")
    sub.add_parser("generate", help="print a new random key and its hash")
    sub.add_parser("curve", help="print a new ZeroMQ CURVE key pair (Z85) for KV-event channels")
    args = parser.parse_args(argv)
    if args.command == "curve":
        public, secret = zmq.curve_keypair()
        print(f"public: {public.decode()}")
        print(f"secret: {secret.decode()}")
        return 0
    if args.command == "generate":
        key = generate_key()
        print(f"key:  {key}")
        print(f"hash: {hash_key(key)}")
        return 0
    key = args.key if args.key is not None else _read_key()
    problem = key_problem(key)
    if problem is not None:
        print(f"kvmesh keys hash: {problem}", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0
