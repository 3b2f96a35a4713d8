"""Which engine event streams this replica ingests, and the subscriber tasks that do it.

Without a mesh every replica subscribes to every engine. In a mesh, only each engine's owners (by
rendezvous over live members) subscribe and write into the replicated index; a new owner resumes from
the last seq recorded in the document, so no event is lost when an owner dies (within the engine's
replay buffer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from events.discovery import EventSource
from events.feed import EngineFeed
from events.subscriber import run_subscriber
from index.view import CacheView

log = logging.getLogger("kvmesh.ingest")


@dataclass
class _Stream:
    model: str
    sources: list[EventSource]
    scope: trio.CancelScope | None = None
    feeds: list[EngineFeed] = field(default_factory=list)


class EventIngest:
    def __init__(self, cache: CacheView, mesh=None) -> None:
        self.cache = cache
        self.mesh = mesh
        self._streams: dict[str, _Stream] = {}
        self._owned: set[str] | None = None if mesh is not None else set()
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.mesh is not None:
                owned = self.mesh.watch_ownership(lambda: list(self._streams))
                nursery.start_soon(self._follow_ownership, owned)
            task_status.started()
            await trio.sleep_forever()

    def _should_ingest(self, engine: str) -> bool:
        return self.mesh is None or (self._owned is not None and engine in self._owned)

    def add(self, engine: str, model: str, sources: list[EventSource]) -> None:
        """The engine's event endpoints are known; subscribe now unless another replica owns it."""
        self.remove(engine)
        self._streams[engine] = _Stream(model, sources)
        if self._should_ingest(engine):
            self._start(engine)

    def remove(self, engine: str) -> None:
        stream = self._streams.pop(engine, None)
        if stream is not None and stream.scope is not None:
            stream.scope.cancel()

    def ingesting(self) -> list[str]:
        return sorted(e for e, s in self._streams.items() if s.scope is not None)

    def _start(self, engine: str) -> None:
        stream = self._streams[engine]
        if stream.scope is not None or self._nursery is None:
            return
        resume = self.mesh.resume_seq(engine) if self.mesh is not None else None
        record = (lambda seq: self.mesh.store.set_seq(engine, seq)) if self.mesh is not None else None
        stream.scope = trio.CancelScope()
        stream.feeds = [EngineFeed(engine, stream.model, self.cache, resume_seq=resume, on_applied=record)
                        for _ in stream.sources]
        log.info("ingesting events", extra={"engine": engine, "resume_seq": resume})

        async def subscribe_all(scope: trio.CancelScope = stream.scope) -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    for feed, source in zip(stream.feeds, stream.sources, strict=True):
                        nursery.start_soon(run_subscriber, feed, source)

        self._nursery.start_soon(subscribe_all)

    def _stop(self, engine: str) -> None:
        stream = self._streams.get(engine)
        if stream is not None and stream.scope is not None:
            stream.scope.cancel()
            stream.scope = None
            log.info("stopped ingesting events", extra={"engine": engine})

    async def _follow_ownership(self, owned: trio.MemoryReceiveChannel[set[str]]) -> None:
        async for engines in owned:
            self._owned = engines
            for engine in list(self._streams):
                if engine in engines:
                    self._start(engine)
                else:
                    self._stop(engine)
