"""Room in the index before ingest needs it: the mask table doubles in a worker thread, not in a store call.

The index's mask table (index/mask_table.py) doubles when a store would pass its load limit. Done inside the
store call, on the event loop, re-placing a million blocks held the loop 0.16-0.26 s (``kvmesh bench scale``:
every engine's ingest stopped together and requests waited, once per doubling of the index). Before each
slice of ingest, ``IndexRoom.make`` checks whether the next ``ROOM_BLOCKS`` stores could pass the limit and,
if so, has the doubled table built in a worker thread from the current one while the loop goes on serving
(lookups read the old table meanwhile). The loop adopts it only if nothing wrote the index in between;
otherwise, or where a store outruns the room, the store call still doubles the table itself, as before.
"""

from __future__ import annotations

import logging
import math
import time

import trio

from events.counters import INDEX_REGROWN
from index.prefix_index import PrefixIndex

log = logging.getLogger("kvmesh.events")

ROOM_BLOCKS = 65_536
"""More new blocks than one slice of ingest stores (a slice is a few ms; the fastest ingest is about 1 us
per block op), so the room is made before a slice could need it."""

RETRY_S = 5.0
"""After a failed build, the next try waits this long (stores meanwhile double the table in place)."""


class IndexRoom:
    """Makes room in one index ahead of ingest; one build at a time."""

    def __init__(self, index: PrefixIndex, blocks: int = ROOM_BLOCKS) -> None:
        self.index = index
        self.blocks = blocks
        self._building = False
        self._retry_at = -math.inf

    async def make(self) -> None:
        """Return at once when the index has room for ``blocks`` more; otherwise build the doubled table in a
        worker thread and adopt it if the index was not written meanwhile."""
        index = self.index
        if self._building or not index.needs_room(self.blocks) or trio.current_time() < self._retry_at:
            return
        self._building = True
        try:
            writes = index.writes
            began = time.perf_counter()
            try:
                regrown = await trio.to_thread.run_sync(index.regrown, self.blocks)
            except Exception as exc:  # noqa: BLE001 - e.g. no memory for the copy: a store still doubles in place
                INDEX_REGROWN.labels(outcome="failed").inc()
                if self._retry_at == -math.inf:
                    log.warning("index table not regrown ahead of ingest; stores double it in place",
                                extra={"error": repr(exc)})
                self._retry_at = trio.current_time() + RETRY_S
                return
            self._retry_at = -math.inf
            adopted = index.adopt(regrown, writes)
            INDEX_REGROWN.labels(outcome="adopted" if adopted else "stale").inc()
            log.info("index table regrown ahead of ingest", extra={
                "slots": regrown.size, "blocks": regrown.live, "adopted": adopted,
                "ms": round(1000 * (time.perf_counter() - began), 1)})
        finally:
            self._building = False
