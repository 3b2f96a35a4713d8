"""The process's live poller on real ZeroMQ sockets (inproc): one task drains every busy socket, gives a quiet
one back, and hands each socket's failure to the subscriber that handed it over."""

from __future__ import annotations

import itertools
import time

import pytest
import trio
import zmq

from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from events.live_poller import LivePoller, go_ahead, next_tick_s
from index.prefix_index import PrefixIndex
from index.view import CacheView

_names = itertools.count()


class Pair:
    """A PUB bound in-process and a SUB connected to it, the subscription settled."""

    def __init__(self, context: zmq.Context) -> None:
        address = f"inproc://poller-{next(_names)}"
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(address)
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(address)
        self.received: list[bytes] = []

    async def settle(self) -> None:
        """Publish until the SUB gets a message (a subscription reaches the PUB asynchronously)."""
        with trio.fail_after(5):
            while True:
                self.pub.send(b"hello")
                await trio.sleep(0.01)
                if self.sub.poll(0):
                    while self.sub.poll(0):
                        self.sub.recv()
                    return

    def handle(self, frames: list[bytes]) -> None:
        self.received.extend(frames)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.sub.close(linger=0)


def feed() -> EngineFeed:
    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True)
    return EngineFeed("e", "tiny", view)


async def until(condition) -> None:
    with trio.fail_after(5):
        while not condition():
            await trio.sleep(0.005)


@pytest.fixture
async def pairs():
    context = zmq.Context()
    made = [Pair(context) for _ in range(3)]
    for pair in made:
        await pair.settle()
    yield made
    for pair in made:
        pair.close()
    context.term()


def test_a_poller_needs_a_positive_tick():
    with pytest.raises(ValueError):
        LivePoller(IngestBudget(), tick_s=0)


async def test_one_task_drains_every_busy_socket_and_gives_quiet_ones_back(pairs):
    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=4)
    drained_by: set[object] = set()
    returned: list[int] = []

    async def handed(i: int, pair: Pair, f: EngineFeed) -> None:
        def handle(frames: list[bytes]) -> None:
            drained_by.add(trio.lowlevel.current_task())
            pair.handle(frames)
        await poller.hand_over(pair.sub, handle, f, trio.current_time, go_ahead)
        returned.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        for i, pair in enumerate(pairs):
            nursery.start_soon(handed, i, pair, feed())
        await until(lambda: poller.handed() == 3)
        for n in range(5):
            for pair in pairs:
                pair.pub.send(b"m%d" % n)
        await until(lambda: all(len(pair.received) == 5 for pair in pairs))
        assert [pair.received for pair in pairs] == [[b"m0", b"m1", b"m2", b"m3", b"m4"]] * 3
        assert len(drained_by) == 1  # one task drained all three sockets
        await until(lambda: len(returned) == 3)  # quiet for four ticks: each socket went back
        assert poller.handed() == 0
        pairs[0].pub.send(b"later")
        await trio.sleep(0.05)
        assert pairs[0].received[-1] == b"m4"  # a socket given back is not drained by the poller
        nursery.cancel_scope.cancel()


async def test_a_poller_with_nothing_to_drain_waits_for_a_socket_to_signal(pairs):
    """A handed-over socket stays with the poller while its engine publishes now and then (a batch every 16
    tokens of one answer): ticks that find nothing are not repeated, a message wakes the poller."""
    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=100_000, idle_ticks=100_000)
    checks: list[float] = []
    waiting = poller._waiting

    def counted(handed):
        checks.append(trio.current_time())
        return waiting(handed)

    poller._waiting = counted  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        for pair in pairs[:2]:
            nursery.start_soon(poller.hand_over, pair.sub, pair.handle, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 2)
        await trio.sleep(0.1)  # twenty ticks
        assert len(checks) < 10  # ticking through them checked the sockets twenty times
        pairs[1].pub.send(b"wake")
        await until(lambda: pairs[1].received == [b"wake"])  # only its signal can end the wait (500 s)
        pairs[0].pub.send(b"and again")
        await until(lambda: pairs[0].received == [b"and again"])
        assert poller.handed() == 2
        nursery.cancel_scope.cancel()


def explode(frames: list[bytes]) -> None:
    raise KeyError("a frame found a bug")


@pytest.mark.parametrize("failure", ["handler raises", "socket closed"])
async def test_a_sockets_failure_reaches_only_its_own_subscriber(pairs, failure):
    """What draining one socket raises (a bug a frame finds, a socket closed under the poller) ends that
    socket's hand-over with the error; the poller keeps draining the others."""
    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=1_000)
    failed: list[BaseException] = []
    handle = explode if failure == "handler raises" else pairs[0].handle

    async def handed_bad() -> None:
        try:
            await poller.hand_over(pairs[0].sub, handle, feed(), trio.current_time, go_ahead)
        except (KeyError, zmq.ZMQError) as exc:
            failed.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        nursery.start_soon(handed_bad)
        nursery.start_soon(poller.hand_over, pairs[1].sub, pairs[1].handle, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 2)
        if failure == "handler raises":
            pairs[0].pub.send(b"bad")
        else:
            pairs[0].sub.close(linger=0)
        await until(lambda: failed)
        assert poller.handed() == 1
        assert isinstance(failed[0], KeyError if failure == "handler raises" else zmq.ZMQError)
        pairs[1].pub.send(b"good")
        await until(lambda: pairs[1].received == [b"good"])
        nursery.cancel_scope.cancel()


async def test_a_subscriber_that_is_cancelled_takes_its_socket_back_at_once(pairs):
    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=1_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        with trio.CancelScope() as scope:
            nursery.start_soon(poller.hand_over, pairs[1].sub, pairs[1].handle, feed(), trio.current_time,
                               go_ahead)

            async def cancel_soon() -> None:
                await until(lambda: poller.handed() == 2)
                scope.cancel()
            nursery.start_soon(cancel_soon)
            await poller.hand_over(pairs[0].sub, pairs[0].handle, feed(), trio.current_time, go_ahead)
        assert poller.handed() == 1
        pairs[0].pub.send(b"not for the poller")
        pairs[1].pub.send(b"for the poller")
        await until(lambda: pairs[1].received == [b"for the poller"])
        assert pairs[0].received == []
        nursery.cancel_scope.cancel()


async def test_one_engines_backlog_does_not_starve_the_others(pairs):
    """Sockets take turns a budget slice each: an engine with a long backlog does not hold the others' events
    (past their high-water marks those would be lost) until its own are done."""
    poller = LivePoller(IngestBudget(idle_share=1.0, share=1.0, burst_s=10.0), tick_s=0.005, quiet_ticks=1_000)
    order: list[str] = []

    def slow(frames: list[bytes]) -> None:
        until_s = time.perf_counter() + 0.0002  # 0.2 ms of work per message: 200 of them are 40 ms
        while time.perf_counter() < until_s:
            pass
        order.append("backlog")

    def quick(frames: list[bytes]) -> None:
        order.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        nursery.start_soon(poller.hand_over, pairs[0].sub, slow, feed(), trio.current_time, go_ahead)
        nursery.start_soon(poller.hand_over, pairs[1].sub, quick, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 2)
        for n in range(200):
            pairs[0].pub.send(b"%d" % n)
        pairs[1].pub.send(b"one")
        await until(lambda: len(order) == 201)
        assert order.index("other") < 100
        nursery.cancel_scope.cancel()


async def test_every_busy_socket_together_stays_within_the_ingest_budget(pairs):
    """The budget bounds the work of all engines together: sixteen subscribers that each slept out the same
    wait and then each ran a slice took a whole core under a budget of 0.3 (a replica at a 4,000-message
    backlog caught up in 2.95 s of wall time instead of 12.65); drained by one poller, the work done is at
    most the share of the time taken, plus the burst and one slice's overrun."""
    share, burst, work_per_message = 0.25, 0.003, 0.0003
    budget = IngestBudget(share=share, idle_share=share, burst_s=burst, slice_s=0.001)
    poller = LivePoller(budget, tick_s=0.005, quiet_ticks=1_000)
    worked = [0.0]

    def busy(frames: list[bytes]) -> None:
        began = time.perf_counter()
        while time.perf_counter() - began < work_per_message:
            pass
        worked[0] += time.perf_counter() - began

    handled = [0]

    def counted(frames: list[bytes]) -> None:
        busy(frames)
        handled[0] += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        for pair in pairs:
            nursery.start_soon(poller.hand_over, pair.sub, counted, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 3)
        began = trio.current_time()
        for n in range(100):
            for pair in pairs:
                pair.pub.send(b"%d" % n)
        with trio.fail_after(30):
            while handled[0] < 300:
                await trio.sleep(0.005)
        elapsed = trio.current_time() - began
        assert worked[0] >= 0.09
        assert worked[0] <= share * elapsed + burst + 2 * budget.slice_s + work_per_message
        nursery.cancel_scope.cancel()


async def test_a_batch_now_and_then_costs_one_check_not_a_tick_after_it_too(pairs):
    """An engine that publishes a batch every few ticks (one answer streaming): each batch is checked and drained
    once, when it signals; the poller does not come back a tick later to find nothing."""
    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=100_000, idle_ticks=100_000)
    checks = 0
    ready_at_tick = poller._ready_at_tick

    def counted():
        nonlocal checks
        checks += 1
        return ready_at_tick()

    poller._ready_at_tick = counted  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        nursery.start_soon(poller.hand_over, pairs[0].sub, pairs[0].handle, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 1)
        await trio.sleep(0.05)
        checks = 0
        for n in range(10):
            pairs[0].pub.send(b"m%d" % n)
            await until(lambda n=n: len(pairs[0].received) == n + 1)
            await trio.sleep(0.03)  # six ticks
        assert checks <= 14  # a check at the signal and an empty one at the next tick: 20
        nursery.cancel_scope.cancel()


def test_the_tick_stretches_while_draining_takes_a_large_share_of_it_and_shrinks_back():
    base, most = 0.005, 0.02
    tick = base
    for expected in (0.01, 0.02, 0.02):  # drains of 40% of the tick: it doubles, up to the longest
        tick = next_tick_s(tick, 0.4 * tick, base, most)
        assert tick == pytest.approx(expected)
    assert next_tick_s(tick, 0.15 * tick, base, most) == tick  # between the shares: it stays
    for expected in (0.01, 0.005, 0.005):  # drains of 5% of the tick: it halves, down to the base
        tick = next_tick_s(tick, 0.05 * tick, base, most)
        assert tick == pytest.approx(expected)
    with pytest.raises(ValueError):
        LivePoller(IngestBudget(), tick_s=0.01, max_tick_s=0.005)


async def test_a_heavy_stream_stretches_the_poller_tick_and_a_quiet_tick_resets_it(pairs):
    """Each message costs its handler 3 ms, more than a quarter of a 5-ms tick, however fast the machine is; no
    idle wake-up comes between messages (``idle_ticks``), so only handing over a silent socket makes a tick that
    finds nothing."""
    poller = LivePoller(IngestBudget(idle_share=1.0, share=1.0, burst_s=10.0), tick_s=0.005, quiet_ticks=100_000,
                        idle_ticks=100_000)
    pair, silent = pairs[0], pairs[1]

    def heavy(frames: list[bytes]) -> None:
        until_s = time.perf_counter() + 0.003
        while time.perf_counter() < until_s:
            pass
        pair.handle(frames)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        nursery.start_soon(poller.hand_over, pair.sub, heavy, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.handed() == 1)
        for n, tick in enumerate((0.01, 0.02, 0.02, 0.02)):  # doubled to the longest, and held there
            pair.pub.send(b"m%d" % n)
            await until(lambda n=n, tick=tick: len(pair.received) == n + 1 and poller.tick_now == pytest.approx(tick))
        nursery.start_soon(poller.hand_over, silent.sub, silent.handle, feed(), trio.current_time, go_ahead)
        await until(lambda: poller.tick_now == pytest.approx(0.005))  # a tick that found nothing: the base
        nursery.cancel_scope.cancel()
