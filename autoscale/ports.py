"""What the autoscaler needs from the router it runs in, as protocols it owns: the router implements them
(``gateway/autoscale_link.py``), so nothing in ``autoscale/`` imports the gateway."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from autoscale.decision import FleetSignals


class FleetControl(Protocol):
    """The engines this replica routes to, as far as the autoscaler changes them."""

    def known(self, engine_id: str) -> bool:
        """Whether this replica routes to the engine."""

    def register(self, engine_id: str, url: str, island: str | None) -> None:
        """Route to a provisioned engine (on every replica); ValueError when its URL or island is unusable."""

    def release(self, engine_id: str) -> None:
        """Stop routing to the engine, on every replica."""

    def drain(self, engine_id: str, handover_in_s: float) -> None:
        """No new requests; streams still running ``handover_in_s`` from now move to other engines."""

    def undrain(self, engine_id: str) -> None:
        """Back into rotation (a drain this replica may no longer finish)."""

    def idle(self, engine_id: str, since: float) -> bool:
        """Nothing runs on the engine, as seen after ``since`` (trio time)."""


class SignalSource(Protocol):
    """What the router sees of its fleet, as the decision core's signals."""

    def read(self, managed: Mapping[str, float], draining: set[str], pending: int) -> FleetSignals:
        """``managed``: engines the autoscaler may release, with their price per hour."""
