"""trio task tree of one engine event publisher: ZMQ SUB for live batches, DEALER for replays.

The SUB socket is drained with NOBLOCK in slices of work charged to the process's IngestBudget
(events/ingest_budget.py, events/socket_drain.py), which measured far faster here than zmq-anyio and keeps
request handling from starving behind a busy fleet's events. A quiet socket is waited on through its
(edge-triggered) FD; once a message woke it, the socket is handed to the process's LivePoller
(events/live_poller.py), which drains every busy socket once per tick in one task, until it is quiet
again. All decisions are taken by the sans-IO EngineFeed; this module only moves frames and reconnects
with backoff.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
import zmq

from events.counters import SUBSCRIBER_RESTARTS
from events.curve import CurveClient
from events.discovery import EventSource
from events.feed import DEFAULT_MAX_PAYLOAD, EngineFeed
from events.ingest_budget import IngestBudget
from events.live_poller import LivePoller, go_ahead
from events.socket_drain import drain, drain_slice, readable, wait_for_budget


class PublisherDisconnected(Exception):
    """The SUB lost its publisher; libzmq does not reconnect after e.g. a MAXMSGSIZE violation."""


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    rcvhwm: int = 1_000
    """Messages (one engine step each) queued per socket while ingest is behind; past it libzmq drops live
    batches, which the seq tracker sees as a gap and fills from the engine's replay buffer once ingest has
    time again. With vLLM's own 100,000 and 16 MiB messages a lagging replica's queue grew without a useful
    bound (700 MB in 40 s at twice the sustainable rate); 1,000 steps are ~10 s of a busy engine and about
    20 MB at the realistic mix's ~20 KB per step (the hard bound is 1,000 x ``max_message_bytes`` per socket)."""
    max_message_bytes: int = DEFAULT_MAX_PAYLOAD
    """As large as the feed accepts: bigger is cut off by libzmq."""
    replay_timeout_s: float = 5.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    curve_client: CurveClient | None = None
    """The router's CURVE key pair, for sources that name a server key (events/curve.py)."""
    tick_s: float = 0.005
    """How often the process's LivePoller drains the sockets of engines that publish: the index is up to
    this much later, and ingest wakes the loop at most this often while engines publish (while draining takes a
    large share of each tick, ticks stretch up to four times this: ``events.live_poller.next_tick_s``)."""
    quiet_ticks: int = 20
    """Ticks in a row without a message after which a socket goes back to waiting on its FD."""

    def poller(self, budget: IngestBudget, room: Callable[[EngineFeed], Awaitable[None]] | None = None) -> LivePoller:
        """The poller every subscriber of a process shares, drawing on ``budget`` (and awaiting ``room`` before
        each slice)."""
        return LivePoller(budget, self.tick_s, self.quiet_ticks, room)


def _configure(sock: zmq.Socket, config: SubscriberConfig, source: EventSource) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    if source.curve_server_key is not None:
        if config.curve_client is None:
            raise ValueError("the engine's events need CURVE (curve_server_key) but the router has no "
                             "events_curve_secret_file")
        config.curve_client.secure(sock, source.curve_server_key)


async def run_subscriber(feed: EngineFeed, source: EventSource, *, context: zmq.Context | None = None,
                         config: SubscriberConfig | None = None,
                         clock: Callable[[], float] = trio.current_time,
                         poller: LivePoller | None = None,
                         before_ingest: Callable[[], Awaitable[None]] = go_ahead) -> None:
    """Run until cancelled, rebuilding the session with exponential backoff after errors/disconnects.
    ``poller``: shared by every subscriber of a process, with the process's ingest budget (the loop they
    share is one), and run by its owner; when None, this subscriber runs its own.
    ``before_ingest``: awaited before each pass over the live messages queued (a router lets the engine's
    pending first tokens go first, see gateway/first_tokens.py)."""
    config = config or SubscriberConfig()
    context = context or zmq.Context.instance()
    if poller is None:
        async with trio.open_nursery() as nursery:
            own = config.poller(IngestBudget())
            nursery.start_soon(own.run)
            await _subscribe(feed, source, context, config, clock, own, before_ingest)
        return
    await _subscribe(feed, source, context, config, clock, poller, before_ingest)


async def _subscribe(feed: EngineFeed, source: EventSource, context: zmq.Context, config: SubscriberConfig,
                     clock: Callable[[], float], poller: LivePoller,
                     before_ingest: Callable[[], Awaitable[None]]) -> None:
    backoff = config.backoff_initial_s
    while True:
        started = trio.current_time()
        try:
            await _session(feed, source, context, config, clock, poller, before_ingest)
        except* zmq.ZMQError:
            SUBSCRIBER_RESTARTS.labels(engine=feed.engine, reason="socket_error").inc()
        except* PublisherDisconnected:
            SUBSCRIBER_RESTARTS.labels(engine=feed.engine, reason="disconnected").inc()
            feed.on_publisher_lost()
        if trio.current_time() - started > config.backoff_max_s:
            backoff = config.backoff_initial_s
        await trio.sleep(backoff)
        backoff = min(config.backoff_max_s, backoff * 2)


async def _session(feed: EngineFeed, source: EventSource, context: zmq.Context, config: SubscriberConfig,
                   clock: Callable[[], float], poller: LivePoller,
                   before_ingest: Callable[[], Awaitable[None]]) -> None:
    budget = poller.budget
    sub = context.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        _configure(sub, config, source)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode("utf-8"))
        sub.connect(source.endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, monitor)
            running: list[trio.CancelScope] = []

            def replay(start: int | None) -> None:
                """Start the replay the feed asked for, cancelling the one it replaces."""
                if start is None:
                    return
                for scope in running:
                    scope.cancel()
                running[:] = [trio.CancelScope()]
                nursery.start_soon(_replay, feed, source, start, feed.replay_generation, running[0], context,
                                   config, clock, budget)

            def handle(frames: list[bytes]) -> None:
                replay(feed.on_live(frames, clock()))

            replay(feed.catch_up(clock()))
            while True:
                await readable(sub)
                await before_ingest()
                await wait_for_budget(budget, [(feed, clock)])
                drain_slice(sub, budget, handle, feed)  # what woke it, at once; the poller does the rest
                await poller.hand_over(sub, handle, feed, clock, before_ingest)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)


async def _watch_disconnect(monitor: zmq.Socket) -> None:
    await readable(monitor)
    raise PublisherDisconnected


async def _replay(feed: EngineFeed, source: EventSource, start: int, generation: int, scope: trio.CancelScope,
                  context: zmq.Context, config: SubscriberConfig, clock: Callable[[], float],
                  budget: IngestBudget) -> None:
    """Ask the engine's ROUTER for batches >= start; the feed orders them with held live batches. Every
    reply carries this replay's generation, so a replay the feed has moved past changes nothing."""
    if source.replay_endpoint is None:
        feed.on_replay_failed(clock(), generation)
        return
    with scope:
        await _replay_session(feed, source, start, generation, context, config, clock, budget)


async def _replay_session(feed: EngineFeed, source: EventSource, start: int, generation: int,
                          context: zmq.Context, config: SubscriberConfig, clock: Callable[[], float],
                          budget: IngestBudget) -> None:
    dealer = context.socket(zmq.DEALER)
    done = False
    try:
        _configure(dealer, config, source)
        dealer.connect(source.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        with trio.move_on_after(config.replay_timeout_s):
            while not done:
                await readable(dealer)
                done = await drain(dealer, budget, lambda frames: feed.on_replay(frames, clock(), generation),
                                    feed, clock)
    finally:
        dealer.close(linger=0)
        if not done:
            feed.on_replay_failed(clock(), generation)
