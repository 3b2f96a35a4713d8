"""Requests of one engine waiting for their first response byte, so that event ingest can let them go first.

An engine publishes a prefill step's KV events as that step's first tokens leave it: a batch for an
8k-token prompt (530 blocks) took the router's loop 3-6 ms to ingest, and when the batch won the race to
the loop, the client's first token waited behind it (``kvmesh bench overhead``, 8k turn). The subscriber
of an engine therefore waits, before each pass over its queued events, until one of that engine's
pending first bytes has arrived, for at most a few milliseconds: the index is that much later, and the
first token is not held back by bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

FIRST_BYTE_GRACE_S = 0.003
"""The longest an engine's event ingest waits for a first byte: a few ms, so at high concurrency (a first
byte is nearly always pending) events are that much later, never starved."""


class PendingFirstBytes:
    def __init__(self) -> None:
        self.count = 0
        self._arrived = trio.Event()

    def wait_for_one(self) -> Callable[[], None]:
        """Count a request sent and not answered yet; call the returned function (idempotent) once its first
        byte arrived or the attempt ended."""
        self.count += 1
        done = False

        def arrived() -> None:
            nonlocal done
            if not done:
                done = True
                self.count -= 1
                self._arrived.set()
                self._arrived = trio.Event()

        return arrived

    async def let_first_bytes_pass(self, max_wait_s: float = FIRST_BYTE_GRACE_S) -> None:
        """Return once a pending first byte arrived, at once when none is pending, or after ``max_wait_s``."""
        if self.count:
            with trio.move_on_after(max_wait_s):
                await self._arrived.wait()
