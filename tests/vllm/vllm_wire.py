"""Talking to a real vLLM engine from tests: JSON over HTTP, Prometheus metrics, KV events (live + replay).

Everything waits for a condition with a generous deadline instead of sleeping a fixed time, because the
machine is shared and noisy.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from cluster.vllm_engine import SERVED_MODEL_NAME, VllmEngine
from events.decode import ReplayEnd, decode_live, decode_replay
from index.events import BlockStored, EventBatch

WAIT_S = 60.0
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def post_json(engine: VllmEngine, path: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(
        engine.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else {}


def get_text(engine: VllmEngine, path: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(engine.url + path, timeout=timeout) as resp:
        return resp.read().decode()


def metric(engine: VllmEngine, name: str) -> float:
    """Sum of every series of one metric on the engine's /metrics page."""
    total = 0.0
    for line in get_text(engine, "/metrics").splitlines():
        match = _METRIC_LINE.match(line)
        if match and match.group(1) == name:
            total += float(match.group(3))
    return total


def wait_metric(engine: VllmEngine, name: str, at_least: float, timeout: float = WAIT_S) -> float:
    """Metrics are recorded by the engine's output loop, a moment after the response: wait for them."""
    deadline = time.monotonic() + timeout
    while (value := metric(engine, name)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value} < {at_least}"
        time.sleep(0.1)
    return value


def unique_text(words: int) -> str:
    """Text that no other request shares (so its blocks are new on every engine), about 3 tokens a word."""
    tag = uuid.uuid4().hex
    vocabulary = ["alpha", "import", "return", "value", "print", "class", "self", "index", "block", "cache"]
    body = " ".join(f"{vocabulary[i % len(vocabulary)]}{i}" for i in range(words))
    return f"{tag} {body}"


def chat(engine: VllmEngine, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0} | extra
    return post_json(engine, "/v1/chat/completions", body)


def tokenize_chat(engine: VllmEngine, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    return post_json(engine, "/tokenize", {"model": SERVED_MODEL_NAME, "messages": messages} | extra)["tokens"]


@dataclass
class EventTap:
    """A SUB socket on one engine that keeps every batch it has received, raw and decoded."""

    engine: VllmEngine
    context: zmq.Context
    frames: list[list[bytes]] = field(default_factory=list)
    batches: list[EventBatch] = field(default_factory=list)
    socket: zmq.Socket | None = None

    def open(self) -> EventTap:
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.socket.connect(self.engine.events_endpoint)
        # A SUB misses what is published before its subscription reaches the PUB: send requests that
        # store new blocks until one of their batches arrives.
        self.wait_for(lambda batch: bool(batch.events), kick=self.kick)
        return self

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(0)

    def kick(self) -> None:
        """A request that stores at least one new block."""
        chat(self.engine, [{"role": "user", "content": unique_text(40)}])

    def drain(self, timeout_ms: int) -> list[EventBatch]:
        assert self.socket is not None
        received = []
        if self.socket.poll(timeout_ms):
            while True:
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.frames.append(frames)
                received.append(decode_live(frames))
        self.batches.extend(received)
        return received

    def wait_for(
        self, predicate: Callable[[EventBatch], bool], timeout: float = WAIT_S,
        kick: Callable[[], None] | None = None,
    ) -> EventBatch:
        """The first batch received from now on that satisfies ``predicate`` (kicking the engine if asked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if kick is not None:
                kick()
            for batch in self.drain(500):
                if predicate(batch):
                    return batch
        raise AssertionError(f"no matching event batch from {self.engine.name} within {timeout} s")

    def raw_stored_hashes(self, since: int = 0) -> set[int]:
        """Block hashes exactly as the engine put them on the wire (before the decoder folds them)."""
        hashes: set[int] = set()
        for _topic, _seq, payload in self.frames[since:]:
            for event in msgpack.unpackb(payload, raw=False)[1]:
                if event["type"] == "BlockStored":
                    hashes.update(event["block_hashes"])
        return hashes

    def stored_blocks(self) -> dict[int, tuple[int | None, tuple[int, ...], Any]]:
        """Every stored block seen so far: engine hash -> (parent hash, its tokens, its extra keys)."""
        blocks: dict[int, tuple[int | None, tuple[int, ...], Any]] = {}
        for batch in self.batches:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    size = event.block_size
                    for i, block_hash in enumerate(event.block_hashes):
                        extra = event.extra_keys[i] if event.extra_keys else None
                        blocks[block_hash] = (parent, event.token_ids[i * size:(i + 1) * size], extra)
                        parent = block_hash
        return blocks

    def chain_for(self, tokens: list[int], block_size: int, timeout: float = WAIT_S) -> list[int]:
        """Engine hashes of the full blocks of ``tokens``, in order, waiting until all were announced."""
        want = len(tokens) // block_size
        deadline = time.monotonic() + timeout
        while True:
            chain = self._follow(tokens, block_size, want)
            if len(chain) == want:
                return chain
            assert time.monotonic() < deadline, f"only {len(chain)} of {want} blocks announced"
            self.drain(500)

    def _follow(self, tokens: list[int], block_size: int, want: int) -> list[int]:
        blocks = self.stored_blocks()
        chain: list[int] = []
        for i in range(want):
            span = tuple(tokens[i * block_size:(i + 1) * block_size])
            parent = chain[-1] if chain else None
            found = [h for h, (p, toks, _) in blocks.items() if toks == span and (i == 0 or p == parent)]
            if len(found) != 1:
                break
            chain.append(found[0])
        return chain


def replay(engine: VllmEngine, context: zmq.Context, start_seq: int, timeout_ms: int = 10_000) -> list[EventBatch]:
    """Every buffered batch with seq >= start_seq, through the engine's replay ROUTER, up to the end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(timeout_ms), f"replay from {engine.name} stalled"
            decoded = decode_replay(dealer.recv_multipart())
            if isinstance(decoded, ReplayEnd):
                return batches
            batches.append(decoded)
    finally:
        dealer.close(0)
