"""Real ZeroMQ on loopback: a test-local PUB + ROUTER speaking vLLM's wire format feed the index."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import trio
import zmq
from events_frames import payload, stored_map
from prometheus_client import REGISTRY

from events.curve import CurveClient
from events.discovery import EventSource
from events.feed import EngineFeed
from events.subscriber import SubscriberConfig, go_ahead, run_subscriber
from index.block_hash import chain, root_seed
from index.holders import holder_keys
from index.prefix_index import PrefixIndex
from index.view import CacheView

pytestmark = pytest.mark.integration

MODEL = "tiny"
BLOCK = 4
TOPIC = b"kv"
_names = itertools.count()


class FakeEngine:
    """Publishes one new block per batch on a PUB and answers replays from its buffer on a ROUTER."""

    def __init__(self, context: zmq.Context, rank: int = 0, curve_secret: bytes | None = None) -> None:
        self.rank = rank
        """A data-parallel rank: its own blocks, seqs and sockets, and its number in every batch."""
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
            if curve_secret is not None:  # a CURVE server: only clients that know its public key get in
                sock.curve_server = True
                sock.curve_secretkey = curve_secret
            sock.bind("tcp://127.0.0.1:0")
        self.buffer: list[tuple[int, bytes]] = []
        self.tokens: list[int] = []
        self.seq = 0
        self.epoch = 0
        self.hashes: list[int] = []
        self.replays = 0

    @property
    def source(self) -> EventSource:
        endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        return EventSource(endpoint, self.router.getsockopt(zmq.LAST_ENDPOINT).decode(), TOPIC.decode(), self.rank)

    def restart(self) -> None:
        self.buffer, self.tokens, self.hashes, self.seq = [], [], [], 0
        self.epoch += 1

    def next_block(self, live: bool = True) -> None:
        block = [self.rank * 1_000_000 + self.epoch * 10_000 + self.seq * 100 + i for i in range(BLOCK)]
        self.tokens += block
        engine_hash = 10**8 * self.rank + 1_000_000 * (self.epoch + 1) + self.seq
        body = payload([stored_map([engine_hash], self.hashes[-1] if self.hashes else None, block, BLOCK)],
                       rank=self.rank)
        self.hashes.append(engine_hash)
        self.buffer.append((self.seq, body))
        if live:
            self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), body])
        self.seq += 1

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    async def serve_replays(self) -> None:
        while True:
            while not self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(self.router.getsockopt(zmq.FD))
            identity, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, body in self.buffer:
                if seq >= first:
                    self.router.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big"), body])
            self.router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])

    def expected_chain(self) -> list[int]:
        return chain(self.tokens, BLOCK, root_seed(MODEL))

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


async def catch_up(feed: EngineFeed, engine: FakeEngine) -> None:
    """Keep publishing fresh blocks (slow joiner, reconnects) until the feed has applied the latest."""
    with trio.fail_after(15):
        while True:
            engine.next_block()
            await trio.sleep(0.02)
            if feed.ingest.last_seq == engine.seq - 1 and not feed.replaying:
                return


def dropped(engine: str, reason: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_events_dropped_total", {"engine": engine, "reason": reason}) or 0.0


async def run_case(body, *, max_payload_bytes: int = 1 << 20, config: SubscriberConfig | None = None,
                   before_ingest=go_ahead):
    context = zmq.Context()
    engine = FakeEngine(context)
    name = f"zmq-engine-{next(_names)}"
    store = PrefixIndex()
    view = CacheView(store)
    view.register(name, block_size=BLOCK, has_events=True)
    feed = EngineFeed(name, MODEL, view, max_payload_bytes=max_payload_bytes)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.serve_replays)
            nursery.start_soon(lambda: run_subscriber(feed, engine.source, context=context, config=config,
                                                      before_ingest=before_ingest))
            await body(engine, feed, store, name)
            nursery.cancel_scope.cancel()
    finally:
        engine.close()
        context.term()


async def test_events_flow_and_gap_is_filled_by_replay():
    async def body(engine, feed, store, name):
        await catch_up(feed, engine)
        replays_before = engine.replays
        engine.next_block(live=False)
        engine.next_block(live=False)
        await catch_up(feed, engine)
        assert engine.replays > replays_before
        full = engine.expected_chain()
        assert store.overlap(full) == {name: len(full)}
        assert feed.freshness.lost_batches == 0

    await run_case(body)


async def test_live_events_wait_for_what_the_router_lets_pass_first():
    """The router lets an engine's pending first bytes go before ingesting its events."""
    gate = trio.Event()
    gated = False

    async def before_ingest():
        if gated:
            await gate.wait()

    async def body(engine, feed, store, name):
        nonlocal gated
        await catch_up(feed, engine)
        gated = True
        engine.next_block()
        await trio.sleep(0.3)
        assert feed.ingest.last_seq == engine.seq - 2  # queued in ZMQ, not ingested
        gated = False
        gate.set()
        await catch_up(feed, engine)
        full = engine.expected_chain()
        assert store.overlap(full) == {name: len(full)}

    await run_case(body, before_ingest=before_ingest)


async def test_seq_reset_drops_the_engines_blocks():
    async def body(engine, feed, store, name):
        await catch_up(feed, engine)
        await catch_up(feed, engine)
        old = engine.expected_chain()
        assert store.overlap(old) == {name: len(old)}
        # A restart is seen as a seq going backwards; one that starts over at the very seq we last saw
        # would look like a duplicate, so the engine here has published at least two batches.
        engine.restart()
        await catch_up(feed, engine)
        assert store.overlap(old) == {}
        assert store.block_count(name) == engine.seq
        assert feed.freshness.resets >= 1

    await run_case(body)


async def test_malformed_and_oversized_frames_are_counted_and_dropped():
    async def body(engine, feed, store, name):
        await catch_up(feed, engine)
        engine.send_raw([TOPIC, b"short", b"x"])
        engine.send_raw([TOPIC, (0).to_bytes(8, "big"), b"\xc1\xc1"])
        engine.send_raw([TOPIC, (0).to_bytes(8, "big"), b"x" * 8000])
        with trio.fail_after(15):
            while dropped(name, "seq_length") < 1 or dropped(name, "msgpack") < 1 or dropped(name, "oversized") < 1:
                await trio.sleep(0.02)
        # Past MAXMSGSIZE libzmq drops the connection, and with it whatever it had not handed over yet: sent
        # only once the frames above are counted, so the test does not race the disconnect.
        engine.send_raw([TOPIC, (0).to_bytes(8, "big"), b"y" * 200_000])
        await catch_up(feed, engine)
        assert dropped(name, "oversized") == 1
        full = engine.expected_chain()
        assert store.overlap(full) == {name: len(full)}

    await run_case(body, max_payload_bytes=4096, config=SubscriberConfig(max_message_bytes=65536))


async def test_a_data_parallel_rank_that_restarts_costs_the_other_rank_nothing():
    """Two ranks of one engine publish on their own sockets with their own seqs; rank 1 restarts."""
    context = zmq.Context()
    ranks = [FakeEngine(context, rank) for rank in (0, 1)]
    name = f"zmq-dp-engine-{next(_names)}"
    view = CacheView(PrefixIndex())
    view.register(name, block_size=BLOCK, has_events=True)
    holders = holder_keys(name, [0, 1])
    view.set_holders(name, holders)
    feeds = [EngineFeed(name, MODEL, view, holder=holder) for holder in holders]

    def overlap(expected: list[int]) -> int:
        return view.overlaps({BLOCK: expected}, [name], 0.0)[name].exact_blocks

    try:
        async with trio.open_nursery() as nursery:
            for engine, feed in zip(ranks, feeds, strict=True):
                nursery.start_soon(engine.serve_replays)
                nursery.start_soon(lambda e=engine, f=feed: run_subscriber(f, e.source, context=context))
            for _ in range(2):
                for engine, feed in zip(ranks, feeds, strict=True):
                    await catch_up(feed, engine)
            rank0, rank1 = (engine.expected_chain() for engine in ranks)
            assert overlap(rank0) == len(rank0) and overlap(rank1) == len(rank1)
            ranks[1].restart()
            await catch_up(feeds[1], ranks[1])
            assert overlap(rank1) == 0
            assert overlap(rank0) == len(rank0)
            assert overlap(ranks[1].expected_chain()) == ranks[1].seq
            assert view.store.block_count(holders[0]) == ranks[0].seq
            nursery.cancel_scope.cancel()
    finally:
        for engine in ranks:
            engine.close()
        context.term()


async def curve_case(right_key: bool) -> tuple[int, int]:
    """A CURVE publisher and a subscriber that names its public key (or another one): (blocks indexed,
    blocks published)."""
    server_public, server_secret = zmq.curve_keypair()
    given = server_public if right_key else zmq.curve_keypair()[0]
    client = CurveClient(*zmq.curve_keypair())
    context = zmq.Context()
    engine = FakeEngine(context, curve_secret=server_secret)
    name = f"zmq-curve-engine-{next(_names)}"
    view = CacheView(PrefixIndex())
    view.register(name, block_size=BLOCK, has_events=True)
    feed = EngineFeed(name, MODEL, view)
    source = dataclasses.replace(engine.source, curve_server_key=given.decode())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.serve_replays)
            nursery.start_soon(lambda: run_subscriber(feed, source, context=context,
                                                      config=SubscriberConfig(curve_client=client)))
            if right_key:
                await catch_up(feed, engine)
            else:
                for _ in range(40):
                    engine.next_block()
                    await trio.sleep(0.025)
            nursery.cancel_scope.cancel()
        return view.block_count(name), engine.seq
    finally:
        engine.close()
        context.term()


async def test_a_curve_publisher_is_read_with_its_public_key():
    indexed, published = await curve_case(right_key=True)
    assert indexed == published


async def test_a_curve_publisher_named_with_another_key_gives_the_router_nothing():
    indexed, published = await curve_case(right_key=False)
    assert published == 40 and indexed == 0
