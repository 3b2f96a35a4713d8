"""Streams of one engine whose first token has not reached the client, so that event ingest lets them go first.

An engine publishes a prefill step's KV events as that step's first tokens leave it: a batch for an
8k-token prompt (530 blocks) took the router's loop 3-6 ms to ingest, and when the batch won the race to
the loop, the client's first token waited behind it (``kvmesh bench overhead``, 8k turn). Ingest
therefore waits, before each pass over an engine's queued events, until one of that engine's pending
first tokens has gone out, for at most a few milliseconds (the live poller, events/live_poller.py, waits
for every engine of one pass together, at most one tick): the index is that much later, and the first
token is not held back by bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

FIRST_TOKEN_GRACE_S = 0.003
"""The longest an engine's event ingest waits for a first token: a few ms, so at high concurrency (a first
token is nearly always pending) events are that much later, never starved."""


class PendingFirstTokens:
    def __init__(self) -> None:
        self.count = 0
        self._went_out = trio.Event()

    def wait_for_one(self) -> Callable[[], None]:
        """Count a stream sent and waiting for its first token; call the returned function (idempotent) once
        that token went to the client or the attempt ended."""
        self.count += 1
        done = False

        def went_out() -> None:
            nonlocal done
            if not done:
                done = True
                self.count -= 1
                self._went_out.set()
                self._went_out = trio.Event()

        return went_out

    async def let_first_tokens_pass(self, max_wait_s: float = FIRST_TOKEN_GRACE_S) -> None:
        """Return once a pending first token went out, at once when none is pending, or after ``max_wait_s``."""
        if self.count:
            with trio.move_on_after(max_wait_s):
                await self._went_out.wait()
