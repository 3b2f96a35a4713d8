"""Compiled steps over an alias table's words (index/alias_table.py): the home slot of a key, and a rebuild.

A rebuild (growing a table, or sweeping the tombstones an engine at its cap leaves with every eviction) runs in a
worker thread ahead of ingest (events/index_room.py) while every engine's ingest waits for it. With numpy's sort
and placement it held the GIL for most of its 8-10 ms at 65,536 blocks, and beside a busy event loop each one took
5-60 ms of wall time: a fleet of 16 engines at their caps swept about twice a second, and the index fell behind
by up to a second when several came together. Compiled without the GIL it runs beside the loop (1.6-1.8 ms
alone at 65,536 blocks).
"""

from __future__ import annotations

import numpy as np

from index.compiled import compiled, compiled_without_gil

TOMBSTONE = np.uint64(0xFFFFFFFFFFFFFFFF)
"""A removed entry's key word (no stored key reaches it: keys are below 2**63 and stored shifted by one)."""


@compiled
def alias_home(stored: np.uint64, multiplier: np.uint64, size: np.uint64) -> int:
    """The word of the home slot: the top 32 bits of the scrambled key scaled to the table's size."""
    return 2 * np.int64((((stored * multiplier) >> np.uint64(32)) * size) >> np.uint64(32))


@compiled_without_gil
def reinsert_live(words, multiplier, into, into_size):
    """Insert every live entry of ``words`` (neither empty nor a tombstone) into the empty words ``into`` of
    ``into_size`` slots by linear probing from its home; returns how many were inserted, or -1 when they do not fit
    (``words`` written meanwhile by another thread: the caller drops the result). Any order of insertion leaves each
    entry with only occupied slots between its home and its place, which is all a lookup needs."""
    end = 2 * into_size
    usize = np.uint64(into_size)
    placed = 0
    for i in range(0, words.shape[0], 2):
        stored = words[i]
        if stored == 0 or stored == TOMBSTONE:
            continue
        if placed == into_size:
            return -1
        at = alias_home(stored, multiplier, usize)
        while into[at] != 0:
            at = at + 2 if at + 2 < end else 0
        into[at] = stored
        into[at + 1] = words[i + 1]
        placed += 1
    return placed
