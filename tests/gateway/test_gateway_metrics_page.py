"""A page written in parts is the library's page, byte for byte, and writing it lets other tasks run."""

from __future__ import annotations

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)

from gateway.metrics_page import PART_SAMPLES, family_parts, page_parts, write_page


def _registry(gauges: int, histograms: int, counters: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    gauge = Gauge("demo_in_flight", "Requests in flight\nper engine, \\ escaped", ["engine"], registry=registry)
    histogram = Histogram("demo_ttft_seconds", "TTFT", ["engine"], registry=registry)
    counter = Counter("demo_polls", "Polls by outcome", ["engine", "outcome"], registry=registry)
    Gauge("demo_up", "Unlabelled", registry=registry).set(1)
    for i in range(gauges):
        gauge.labels(f'e"{i}').set(i / 3)
    for i in range(histograms):
        histogram.labels(f"e{i}").observe(i * 0.01)
    for i in range(counters):
        counter.labels(f"e{i}", "ok").inc(i)
    return registry


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * PART_SAMPLES), st.integers(0, 40), st.integers(0, 2 * PART_SAMPLES))
def test_the_parts_join_into_the_librarys_page(gauges, histograms, counters):
    registry = _registry(gauges, histograms, counters)
    parts = list(page_parts([registry]))
    assert b"".join(parts) == generate_latest(registry)
    assert all(part.count(b"\n# HELP ") == 0 for part in parts if not part.startswith(b"# HELP "))


def test_with_created_series_off_as_in_the_router_counters_and_histograms_are_written_in_parts_too():
    """With created series on (the library's default) a counter or histogram family is written whole; the router turns
    them off, so its per-engine histograms and counters take the parts."""
    disable_created_metrics()
    try:
        registry = _registry(0, 40, 2 * PART_SAMPLES + 3)
        families = {family.name: list(family_parts(family)) for family in registry.collect()}
        assert len(families["demo_ttft_seconds"]) > 1 and len(families["demo_polls"]) == 3
        assert b"".join(page_parts([registry])) == generate_latest(registry)
    finally:
        enable_created_metrics()


def test_a_big_family_is_written_in_parts_with_its_headers_once():
    registry = _registry(2 * PART_SAMPLES + 5, 0, 0)
    family = next(f for f in registry.collect() if f.name == "demo_in_flight")
    parts = list(family_parts(family))
    assert len(parts) == 3
    assert parts[0].startswith(b"# HELP demo_in_flight ") and all(p.startswith(b"demo_in_flight{") for p in parts[1:])
    assert b"".join(parts).count(b"# TYPE demo_in_flight gauge") == 1


async def test_writing_a_page_lets_other_tasks_run_between_its_parts():
    parts = list(page_parts([_registry(3 * PART_SAMPLES, 40, PART_SAMPLES)]))
    ticks = 0
    written = trio.Event()

    async def other_task() -> None:
        nonlocal ticks
        while not written.is_set():
            ticks += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.sleep(0)
        page = await write_page(parts, yield_every_s=0.0)
        written.set()
    assert page == b"".join(parts)
    assert ticks >= len(parts) - 1, (ticks, len(parts))
