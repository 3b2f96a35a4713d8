"""The provider interface: provision (asynchronously, with a callback when ready), terminate, list.

A provider is attached to a trio nursery by the loop that owns it; ``provision`` returns at once with a
request id and the work runs in that nursery, so a slow cloud never blocks a decision. Every call carries
``term``, the caller's lease term (autoscale/lease.py): it only grows, so a provider can refuse a caller
older than one it has seen, and ``<name>-<term>-<n>`` request ids are unique across the mesh and its
restarts (the Kubernetes example names pods after them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from autoscale.offers import Offer


class ProviderError(RuntimeError):
    """The provider could not do what was asked; the message says why."""


@dataclass(frozen=True)
class ProvisionedEngine:
    id: str
    url: str
    offer: str = ""
    island: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> ProvisionedEngine:
        """From an untrusted JSON object; ProviderError when it does not name an id and an http(s) URL."""
        if not isinstance(data, dict):
            raise ProviderError(f"expected a JSON object for an engine, got {type(data).__name__}")
        engine_id, url = data.get("id"), data.get("url")
        if not isinstance(engine_id, str) or not engine_id or "\x1f" in engine_id:
            raise ProviderError("engine without a usable string id")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ProviderError(f"engine {engine_id!r} without an http(s) url")
        island = data.get("island")
        offer = data.get("offer")
        return cls(engine_id, url, offer if isinstance(offer, str) else "",
                   island if isinstance(island, str) else None)


@dataclass(frozen=True)
class ProvisionResult:
    request_id: str
    offer: Offer
    engine: ProvisionedEngine | None = None
    error: str = ""


ReadyCallback = Callable[[ProvisionResult], None]


class Provider(ABC):
    """Subclasses implement ``_provision`` (until the engine is ready), ``terminate`` and ``list``."""

    name = "provider"

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._requests = 0

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def provision(self, offer: Offer, on_ready: ReadyCallback, term: int) -> str:
        """Start one engine of ``offer``; ``on_ready`` gets the engine (or the error) once it is known."""
        if self._nursery is None:
            raise RuntimeError("attach the provider to a nursery first")
        self._requests += 1
        request_id = f"{self.name}-{term}-{self._requests}"

        async def run() -> None:
            try:
                engine = await self._provision(request_id, offer, term)
            except ProviderError as exc:
                on_ready(ProvisionResult(request_id, offer, error=str(exc)))
                return
            except Exception as exc:  # a provider's bug is reported like its failures, never raised
                on_ready(ProvisionResult(request_id, offer, error=f"{type(exc).__name__}: {exc}"))
                return
            on_ready(ProvisionResult(request_id, offer, engine))

        self._nursery.start_soon(run)
        return request_id

    @abstractmethod
    async def _provision(self, request_id: str, offer: Offer, term: int) -> ProvisionedEngine:
        """Start an engine for ``offer`` and return it once it answers; ProviderError when it cannot."""

    @abstractmethod
    async def terminate(self, engine_id: str, term: int) -> None:
        """Release the engine (after the loop drained it)."""

    @abstractmethod
    async def list(self, term: int) -> list[ProvisionedEngine]:
        """The engines this provider runs now."""
