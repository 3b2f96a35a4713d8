"""A Prometheus page written in parts, so a scrape lets the event loop run between them.

prometheus_client writes about 7 us of text per sample, all of a registry at once: a replica's page in front of 64
engines (2,826 lines with created series on) took 19 ms and in front of 256 engines (10,698 lines) 76 ms, and every
request waited that long each time Prometheus scraped. Here each metric family is written on its own, a big family
(a per-engine histogram) in parts of ``PART_SAMPLES`` samples, by the library's own writer; ``write_page`` yields to
the loop whenever ``yield_every_s`` of writing has passed. What is left in one piece is the collection of one
family (the library builds all its samples at once). Families are read one after another, so those of one page may
come from moments a few milliseconds apart (each family is read whole, under its own lock).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import trio
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PART_SAMPLES = 256
YIELD_EVERY_S = 0.001
_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")
"""Samples the text format moves to the end of their family under headers of their own: such a family is written
whole (created series are off in the router, and it has no gauge histograms)."""


class _Collected(Collector):
    """Families already collected, for the library's writer."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def family_parts(family: Metric) -> Iterator[bytes]:
    """The family's text in order: its headers and first samples, then the rest ``PART_SAMPLES`` at a time."""
    samples = family.samples
    moved = {family.name + suffix for suffix in _OPENMETRICS_SUFFIXES}
    if len(samples) <= PART_SAMPLES or any(sample.name in moved for sample in samples):
        yield generate_latest(_Collected([family]))
        return
    for start in range(0, len(samples), PART_SAMPLES):
        part = Metric(family.name, family.documentation, family.type, family.unit)
        part.samples = samples[start:start + PART_SAMPLES]
        text = generate_latest(_Collected([part]))
        yield text if start == 0 else text.split(b"\n", 2)[2]  # the HELP and TYPE lines once per family


def page_parts(registries: Iterable[Collector]) -> Iterator[bytes]:
    """Every family of every registry, in parts (``b"".join`` of them is ``generate_latest`` of each, in turn)."""
    for registry in registries:
        for family in registry.collect():
            yield from family_parts(family)


async def write_page(parts: Iterable[bytes], yield_every_s: float = YIELD_EVERY_S) -> bytes:
    """The joined parts, letting other tasks run whenever ``yield_every_s`` of writing has passed."""
    written: list[bytes] = []
    since = time.perf_counter()
    for part in parts:
        written.append(part)
        if time.perf_counter() - since >= yield_every_s:
            await trio.lowlevel.checkpoint()
            since = time.perf_counter()
    return b"".join(written)
