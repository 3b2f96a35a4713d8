"""Ingest in a child process (gateway/process_ingest.py, gateway/ingest_worker.py): a real worker process and
real ZeroMQ publishers on loopback feed the serving process's index through the worker's notes."""

from __future__ import annotations

import os
import signal

import msgpack
import pytest
import trio
import zmq
from prometheus_client import REGISTRY
from test_events_zmq import BLOCK, MODEL, FakeEngine

from events.ingest_budget import IngestBudget
from events.worker_notes import encode_notes
from gateway.ingest_worker import NICENESS
from gateway.process_ingest import ProcessIngest, WorkerFailed
from index.prefix_index import PrefixIndex
from index.view import CacheView

pytestmark = pytest.mark.integration


async def _until(predicate, timeout_s: float = 60.0, publish=None) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            if publish is not None:
                publish()
            await trio.sleep(0.05)


async def test_the_serving_index_follows_every_engine_through_the_worker_and_its_restart():
    context = zmq.Context()
    engines = [FakeEngine(context), FakeEngine(context)]
    names = [f"process-ingest-{os.getpid()}-{i}" for i in range(2)]
    store = PrefixIndex()
    view = CacheView(store)
    for name in names:
        view.register(name, block_size=BLOCK, has_events=True)
    ingest = ProcessIngest(view, budget=IngestBudget(serving=lambda: False))

    def whole(i: int) -> bool:
        chain = engines[i].expected_chain()
        return bool(chain) and store.overlap(chain).get(names[i]) == len(chain) and \
            ingest.applied.get(names[i]) == engines[i].seq - 1

    try:
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(engine.serve_replays)
            await nursery.start(ingest.run)
            for name, engine in zip(names, engines, strict=True):
                ingest.add(name, MODEL, [engine.source])
            await _until(lambda: ingest.worker_pid is not None)
            # the worker's subscriptions join late (slow joiner): keep publishing until both chains are whole
            await _until(lambda: whole(0) and whole(1), publish=lambda: [e.next_block() for e in engines])
            assert view.info(names[0]).freshness.last_seq == engines[0].seq - 1
            # requests come first: the kernel ranks the worker below this process when both want a core
            assert os.getpriority(os.PRIO_PROCESS, ingest.worker_pid) == os.getpriority(os.PRIO_PROCESS, 0) + NICENESS
            # the worker's counters reach this process's registry: one stored block per batch, none counted twice
            await _until(lambda: REGISTRY.get_sample_value(
                "kvmesh_event_block_ops_total", {"engine": names[0], "op": "stored"}) == engines[0].seq)

            # a gap the worker fills by replay reaches this index too
            engines[1].next_block(live=False)
            await _until(lambda: whole(1), publish=engines[1].next_block)

            # the worker killed: a new one gets every engine with the blocks held here, and resumes from the seq
            # applied here, so nothing is lost or applied twice
            pid = ingest.worker_pid
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: ingest.worker_pid not in (None, pid))
            engines[0].next_block(live=False)  # published while no worker listened: only a replay has it
            await _until(lambda: whole(0) and whole(1), publish=lambda: [e.next_block() for e in engines])
            assert ingest.stats["worker_starts"] == 2
            assert ingest.stats["worker_failures"] == 1
            assert store.block_count(names[0]) == len(engines[0].expected_chain())

            # an engine removed is forgotten by the worker, and its late notes do not put its blocks back
            ingest.remove(names[1])
            view.unregister(names[1])
            engines[1].next_block()
            await trio.sleep(0.5)
            assert store.block_count(names[1]) == 0
            nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
        context.term()


async def test_a_message_that_does_not_decode_ends_the_worker_and_changes_nothing():
    """The worker is a process outside this one: a malformed message is refused whole (the supervisor then starts
    a new worker), and the notes of the well-formed message before it are applied."""
    context = zmq.Context()
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    view = CacheView(PrefixIndex())
    view.register("e0", block_size=BLOCK, has_events=True)
    ingest = ProcessIngest(view, budget=IngestBudget(serving=lambda: False))
    ingest._sources["e0"] = "e0"  # noqa: SLF001 - an engine the worker was handed
    try:
        receiver.bind("inproc://notes")
        sender.connect("inproc://notes")
        sender.send_multipart(encode_notes([("s", "e0", [7, 8], [70, 80]), ("e", "e0", "e0", 3)]))
        sender.send_multipart([msgpack.packb([["s", "e0", 1, 2]]), b"\x01" * 8])  # unequal arrays
        sender.send_multipart(encode_notes([("s", "e0", [9], [90])]))
        with trio.fail_after(10), pytest.raises(WorkerFailed):
            await ingest._apply(receiver)  # noqa: SLF001
        assert view.store.block_count("e0") == 2
        assert ingest.applied == {"e0": 3}
        assert view.info("e0").freshness.last_seq == 3
    finally:
        receiver.close(0)
        sender.close(0)
        context.term()
