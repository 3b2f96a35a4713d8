"""Which ticks of an engine's health loop ask its ``/health``, and which the router can answer from what it saw.

A ``/health`` poll costs the router 0.21-0.29 ms of CPU (h11 and trio around one small exchange) and the engine one
request, once per engine per interval, whether the engine is busy or idle: in front of 64 idle simulated engines
they were 45% of the router's samples that were not idle (py-spy). vLLM's ``/health`` says one thing: its engine
core is not dead (it answers 503 once the core died). Two things the router sees anyway say as much in one interval:

- **answered**: the engine's KV events moved since the last tick (its core is scheduling), the router's ingest of
  them is not behind (a backlog applied after the core died would still move them), and its HTTP server answered a
  ``/metrics`` poll since then (the server is up). A core that dies stops its events, so the next tick of an engine
  this router or its peers have requests on polls: there a dead core is found as soon as before.
- **quiet**: nothing of the engine moved since the last tick and neither this router nor its peers have requests on
  it (another client's, which stopped with a dead core, included): a dead quiet engine costs nothing until a
  request goes there, and a request that cannot reach an engine, or gets a server error, is sent to the next one
  before its first byte (``gateway/proxy.py``).

Either way at most ``every - 1`` ticks in a row skip the poll (``events.quiet_polls.quiet_ticks`` sizes it: 4 s at
most between two polls), and a tick always polls while the engine is out of rotation (unhealthy, its breaker open,
a task of it failing, draining or in maintenance) or its last poll failed, so an
engine that stops answering is out of rotation two polls after the first failure, as before. Engines without KV
events (or a router that does not read them) never move: their ``active`` is true and every tick polls.
"""

from __future__ import annotations

from collections.abc import Hashable

ANSWERED = "answered"
QUIET = "quiet"
_UNSEEN = object()


class HealthTicks:
    """Sans-IO: ``skip`` at each tick of the health loop says whether this one leaves ``/health`` alone, and why."""

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._skipped = 0
        self._mark: Hashable = _UNSEEN

    def skip(self, *, routable: bool, active: bool, mark: Hashable, answered: bool) -> str | None:
        """The reason this tick does not poll (``ANSWERED`` or ``QUIET``), or None: poll.

        ``routable``: the engine is in rotation and its last poll succeeded. ``active``: someone has requests on it,
        or the router cannot see its activity (no events, draining, rejoining). ``mark`` changes whenever its events
        do (the first mark seen is not a move). ``answered``: its server answered a ``/metrics`` poll since the last
        tick and the router's ingest of its events is not behind."""
        moved = self._mark is not _UNSEEN and mark != self._mark
        self._mark = mark
        reason = ANSWERED if moved and answered else QUIET if not (active or moved) else None
        if routable and reason is not None and self._skipped + 1 < self.every:
            self._skipped += 1
            return reason
        self._skipped = 0
        return None
