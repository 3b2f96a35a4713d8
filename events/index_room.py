"""Room in the index before ingest needs it: its tables grow or sweep in a worker thread, not in a store call.

The index's mask table (index/mask_table.py) doubles when a store would pass its load limit. Done inside the
store call, on the event loop, re-placing a million blocks held the loop 0.16-0.26 s (``kvmesh bench scale``:
every engine's ingest stopped together and requests waited, once per doubling of the index). Before each
slice of ingest, ``IndexRoom.make`` checks whether the next ``ROOM_BLOCKS`` stores could pass the limit and,
if so, has the doubled table built in a worker thread from the current one while the loop goes on serving
(lookups read the old table meanwhile). The loop adopts it only if nothing wrote the index in between;
otherwise, or where a store outruns the room, the store call still doubles the table itself, as before.
An engine's alias table is swept of the tombstones its removals leave the same way, ahead of the slice that
drains that engine: at 262k blocks per engine each sweep held the loop 70-97 ms, every few seconds somewhere
in a fleet of 16 at 50k block ops/s.
"""

from __future__ import annotations

import logging
import math
import time

import trio

from events.counters import INDEX_REGROWN
from events.feed import EngineFeed
from index.prefix_index import PrefixIndex
from index.tiers import TIER_MEDIA, tier_holder

log = logging.getLogger("kvmesh.events")

ROOM_BLOCKS = 65_536
"""More new blocks than one slice of ingest stores (a slice is a few ms; the fastest ingest is about 1 us
per block op), so the room is made before a slice could need it. A smaller index is given room for half as
many blocks again as it holds (``IndexRoom.room``)."""

RETRY_S = 5.0
"""After a failed build, the next try waits this long (stores meanwhile double the table in place)."""


class IndexRoom:
    """Makes room in one index ahead of ingest; one build at a time."""

    def __init__(self, index: PrefixIndex, blocks: int = ROOM_BLOCKS) -> None:
        self.index = index
        self.blocks = blocks
        self._building = False
        self._retry_at = -math.inf

    def room(self) -> int:
        """New blocks to have room for: ``blocks``, or half the index when that is less.

        A table less than an eighth full shrinks after removals (``MaskTable.shrink_if_sparse``). With room for
        a fixed 65,536 blocks, every index under about 17k blocks (a small fleet at its KV capacity) was
        doubled in a worker thread before each slice and shrunk on the loop by the next removal: 11.5% of a
        router's py-spy samples under `kvmesh bench overhead`, and a loop held for each shrink. Room for half the index
        grows a table to fewer than five slots per block, a shrink waits for eight, and a shrunk table (three
        to seven) has that room. Doubling a table that small in place is cheap: the room is for the 0.16-0.26 s
        doublings near a million blocks."""
        return min(self.blocks, len(self.index) // 2)

    async def make(self, feed: EngineFeed | None = None) -> None:
        """Return at once when the index has room for ``room()`` more blocks and for the next stores of ``feed`` (of
        every holder, without one); otherwise build the tables short of it in a worker thread and adopt them
        if the index was not written meanwhile."""
        index = self.index
        if self._building or trio.current_time() < self._retry_at:
            return
        holders = index.engines() if feed is None else [feed.holder, *(tier_holder(feed.holder, medium)
                                                                       for medium in TIER_MEDIA)]
        blocks = self.room()
        if not index.needs_room(blocks, holders):
            return
        self._building = True
        try:
            writes = index.writes
            began = time.perf_counter()
            try:
                room = await trio.to_thread.run_sync(index.regrown, blocks, holders)
            except Exception as exc:  # noqa: BLE001 - e.g. no memory for the copy: a store still doubles in place
                INDEX_REGROWN.labels(outcome="failed").inc()
                if self._retry_at == -math.inf:
                    log.warning("index table not regrown ahead of ingest; stores double it in place",
                                extra={"error": repr(exc)})
                self._retry_at = trio.current_time() + RETRY_S
                return
            self._retry_at = -math.inf
            adopted = index.adopt(room, writes)
            INDEX_REGROWN.labels(outcome="adopted" if adopted else "stale").inc()
            log.info("index tables rebuilt ahead of ingest", extra={
                "mask_slots": room.masks.size if room.masks else None, "alias_tables": len(room.aliases),
                "adopted": adopted, "ms": round(1000 * (time.perf_counter() - began), 1)})
        finally:
            self._building = False
