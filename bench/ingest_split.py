"""``kvmesh bench ingest --process``: what each side of a replica pays per block op with ``ingest_process``.

The recorded realistic mix (bench/recorded_events.py) goes through the ingest process's code (each engine's
``EngineFeed`` over a ``KeyLedger``, the notes encoded once per tick's worth of messages) and then through the
serving side's (``decode_notes`` and ``apply_notes`` into a ``PrefixIndex``), both in this thread, on a fleet
warmed to its cap, beside ingest on the serving loop (``EngineFeed.on_live`` into a ``PrefixIndex``). CPU time of
this thread per block op, medians of the passes; every kind of pass interleaved with the others.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.event_mix import BLOCK_SIZE
from bench.recorded_events import MODEL, Message, RecordedMix, freeze, recorded_mix
from events.feed import EngineFeed
from events.worker_notes import NotedFreshness, NotedView, apply_notes, decode_notes, encode_notes
from index.key_ledger import KeyLedger
from index.prefix_index import PrefixIndex
from index.view import CacheView

MESSAGES_PER_TICK = 16
"""Messages whose notes go out together: about one 5-ms tick of 16 engines at 150k block ops/s."""


@dataclass(frozen=True)
class SplitCost:
    engines: int
    ops: int
    loop_us: float
    worker_us: float
    serving_us: float
    passes: int

    def line(self) -> str:
        return (f"ingest CPU per block op, {self.engines} engines, {self.ops:,} ops (medians of {self.passes} passes): "
                f"on the serving loop {self.loop_us:.2f} us; with the ingest process, the serving loop "
                f"{self.serving_us:.2f} us ({self.serving_us / self.loop_us:.2f}x) and the ingest process "
                f"{self.worker_us:.2f} us = {1e6 / self.serving_us:,.0f} ops/s per serving core")


def _cpu(work: Callable[[], object]) -> float:
    started = time.thread_time()
    work()
    return time.thread_time() - started


def warmed_fleet(engines: int, warm: list[Message]) -> tuple[CacheView, list[EngineFeed]]:
    """A serving side's index of ``engines`` engines, each feed fed the ``warm`` messages on the loop."""
    view = CacheView(PrefixIndex())
    for i in range(engines):
        view.register(f"e{i}", block_size=BLOCK_SIZE, has_events=True)
    feeds = [EngineFeed(f"e{i}", MODEL, view) for i in range(engines)]
    for i, frames in warm:
        feeds[i].on_live(frames, 0.0)
    return view, feeds


def _worker(engines: int, warm: list[Message]) -> tuple[KeyLedger, list[EngineFeed]]:
    ledger = KeyLedger()
    view = NotedView(ledger, ledger.notes)
    feeds = []
    for i in range(engines):
        view.register(f"e{i}", block_size=BLOCK_SIZE, has_events=True)
        feed = EngineFeed(f"e{i}", MODEL, view)
        feed.freshness = NotedFreshness(f"e{i}", f"e{i}", ledger.notes)
        feeds.append(feed)
    for i, frames in warm:
        feeds[i].on_live(frames, 0.0)
    ledger.notes.clear()
    return ledger, feeds


def _loop_pass(engines: int, mix: RecordedMix) -> float:
    _, feeds = warmed_fleet(engines, mix.fill)
    return _cpu(lambda: [feeds[i].on_live(frames, 1.0) for i, frames in mix.steady])


def _worker_pass(engines: int, mix: RecordedMix) -> tuple[float, list[list[bytes]]]:
    """The ingest process's work, and the messages it sent."""
    ledger, feeds = _worker(engines, mix.fill)
    messages: list[list[bytes]] = []

    def produce() -> None:
        for at, (i, frames) in enumerate(mix.steady, start=1):
            feeds[i].on_live(frames, 1.0)
            if at % MESSAGES_PER_TICK == 0 or at == len(mix.steady):
                messages.append(encode_notes(ledger.notes))
                ledger.notes.clear()

    return _cpu(produce), messages


def _serving_pass(engines: int, mix: RecordedMix, messages: list[list[bytes]]) -> float:
    view, _ = warmed_fleet(engines, mix.fill)
    names = {f"e{i}" for i in range(engines)}
    applied: dict[str, int] = {}
    return _cpu(lambda: [apply_notes(decode_notes(m), view, names.__contains__, applied, 1.0) for m in messages])


def measure_split(engines: int = 16, cap: int = 20_000, steps: int = 100, seed: int = 0,
                  passes: int = 3) -> SplitCost:
    mix = recorded_mix(engines, cap, steps, seed)
    timings: dict[str, list[float]] = {"loop": [], "worker": [], "serving": []}
    freeze()
    for _ in range(max(1, passes)):
        timings["loop"].append(_loop_pass(engines, mix))
        worker_s, messages = _worker_pass(engines, mix)
        timings["worker"].append(worker_s)
        timings["serving"].append(_serving_pass(engines, mix, messages))
    us = 1e6 / mix.steady_ops
    loop_s, worker_s, serving_s = (statistics.median(timings[k]) for k in ("loop", "worker", "serving"))
    return SplitCost(engines, mix.steady_ops, loop_s * us, worker_s * us, serving_s * us, len(timings["loop"]))
