"""The engines this replica routes to: the registry, one watcher per engine, admin state, drains.

Admin, the mesh link and the autoscaler all change the fleet through here, so an engine added by any of
them is watched, replicated and drained the same way. ``add`` / ``remove`` never await (a replicated
registry entry arrives in a callback): they hand the watcher to :meth:`Fleet.run` through a memory
channel, and that one nursery owns every watcher, as ``EventIngest.run`` owns every subscriber.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway.config import EngineConfig, check_engine_label
from gateway.disaggregation.roles import check_protocol, check_role
from gateway.engine_watch import watch_engine
from gateway.engines import EngineRegistry, EngineState
from gateway.event_ingest import EventIngest
from gateway.metrics import RouterMetrics
from gateway.route_planner import RoutePlanner

ADMIN_STATE_KEYS = ("draining", "maintenance", "island", "zone", "role", "kv_protocol")
BOOLEAN_STATE_KEYS = ("draining", "maintenance")
CONFIG_STATE_KEYS = ("island", "role", "kv_protocol")
"""Admin settings kept in the engine's config: an engine re-started with another connector role (or
protocol) is told so with ``PATCH /admin/engines/{id}``, on every replica, without being removed."""

Watch = Callable[[EngineState, RoutePlanner, EventIngest, float], Awaitable[None]]
"""An engine's background tasks (``watch_engine``: health, discovery, metrics, events), run until cancelled."""
Replicate = Callable[[str, dict[str, Any]], None]
"""Publishes an engine's registry entry to the other replicas (installed by the mesh link)."""


def check_engine_setting(key: str, value: Any) -> None:
    """ValueError unless ``value`` has the type of admin setting ``key`` (whether from a client or a peer)."""
    if key in BOOLEAN_STATE_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"'{key}' must be true or false")
    elif key == "role":
        check_role(key, value)
    elif key == "kv_protocol":
        check_protocol(key, value)
    else:
        check_engine_label(key, value)


class SettingError(ValueError):
    """An engine setting that cannot be taken; ``key`` names it."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def check_engine_settings(settings: dict[str, Any]) -> None:
    """SettingError naming the first unknown or mistyped key: settings are replicated fleet-wide as given."""
    unknown = sorted(set(settings) - set(ADMIN_STATE_KEYS))
    if unknown:
        raise SettingError(f"unknown engine setting(s): {', '.join(unknown)}", unknown[0])
    for key, value in settings.items():
        try:
            check_engine_setting(key, value)
        except ValueError as exc:
            raise SettingError(str(exc), key) from None


def registry_settings(entry: dict[str, Any]) -> dict[str, Any]:
    """The admin settings of a replicated registry entry, type-checked; ValueError names the bad one."""
    settings = {key: entry[key] for key in ADMIN_STATE_KEYS if key in entry}
    for key, value in settings.items():
        check_engine_setting(key, value)
    return settings


ENGINE_FIELDS = ("url", "model", "events", "replay", "topic", "block_size", "curve_server_key", "role",
                 "kv_protocol")
"""What an engine's registry entry carries beside its admin state: all of its EngineConfig, so an engine
added on one replica is read the same way on every other (its event endpoints, topic, model, block size
and CURVE server key; before, only the URL travelled and CURVE was silently off elsewhere). None of it is
a secret: the server key is the publisher's public key, and each replica reads events with the key pair in
its own ``events_curve_secret_file`` (a secret by reference: a replica without one refuses the channel).
The role and KV protocol travel too: a replica that took a prefill engine for a whole-request one would
send it decodes."""


def registry_entry(engine: EngineState) -> dict[str, Any]:
    """The registry entry this replica writes for ``engine``: admin state and the whole engine config."""
    config = {key: getattr(engine.config, key) for key in ENGINE_FIELDS}
    return {**config, "url": engine.url, "draining": engine.draining, "maintenance": engine.maintenance,
            "island": engine.config.island, "zone": engine.zone}


@dataclass
class _Watcher:
    engine: EngineState
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class Fleet:
    """The engines of this replica and what may be done to them; :meth:`run` owns their watchers."""

    def __init__(self, engines: EngineRegistry, planner: RoutePlanner, ingest: EventIngest, metrics: RouterMetrics,
                 metrics_interval_s: float, watch: Watch = watch_engine) -> None:
        self.engines = engines
        self.metrics = metrics
        self.watch = watch
        self.planner = planner
        self.ingest = ingest
        self.metrics_interval_s = metrics_interval_s
        self.replicate: Replicate | None = None
        self._watchers: dict[str, _Watcher] = {}
        self._send, self._started = trio.open_memory_channel[_Watcher](math.inf)
        for engine in engines.all():
            self._start_watcher(engine)

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Own every engine's watcher; a watcher removed before it started never starts."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for watcher in self._started:
                if self._watchers.get(watcher.engine.id) is watcher:
                    nursery.start_soon(self._run_watcher, watcher)

    async def _run_watcher(self, watcher: _Watcher) -> None:
        with watcher.scope:
            await self.watch(watcher.engine, self.planner, self.ingest, self.metrics_interval_s)

    def _start_watcher(self, engine: EngineState) -> None:
        watcher = self._watchers[engine.id] = _Watcher(engine)
        self._send.send_nowait(watcher)

    def _replicate(self, engine_id: str, entry: dict[str, Any]) -> None:
        if self.replicate is not None:
            self.replicate(engine_id, entry)

    def add(self, config: EngineConfig, replicate: bool = True) -> str:
        engine = self.engines.add(config)
        if engine.id not in self._watchers:
            self._start_watcher(engine)
        if replicate:
            self._replicate(engine.id, registry_entry(engine))
        return engine.id

    def remove(self, engine_id: str, replicate: bool = True) -> None:
        watcher = self._watchers.pop(engine_id, None)
        if watcher is not None:
            watcher.scope.cancel()
        self.ingest.remove(engine_id)
        self.engines.remove(engine_id)
        self.planner.cache.unregister(engine_id)
        self.metrics.forget_engine(engine_id)
        if replicate:
            self._replicate(engine_id, {"removed": True, "removed_at": round(time.time(), 3)})

    def set_state(self, engine_id: str, state: dict[str, Any], replicate: bool = True) -> None:
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        for key, value in state.items():
            if key in CONFIG_STATE_KEYS:
                setattr(engine.config, key, value)
            elif key in ADMIN_STATE_KEYS:
                setattr(engine, key, value)
        if replicate:
            self._replicate(engine_id, registry_entry(engine))

    def drain(self, engine_id: str, enabled: bool = True, handover_in_s: float | None = None) -> None:
        """Take the engine out of rotation (or back in). With ``handover_in_s``, streams still running on it
        that many seconds from now are continued on other engines (``gateway.proxy``) rather than cut, so
        it can then be stopped without failing anyone. The deadline is this replica's own."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        handover = enabled and handover_in_s is not None
        engine.pool.drain_at = trio.current_time() + max(0.0, handover_in_s) if handover else math.inf
        self.set_state(engine_id, {"draining": enabled})

    def idle(self, engine_id: str, since: float) -> bool:
        """Whether nothing runs on the engine: no request of this replica or its peers, and a /metrics poll
        taken after ``since`` (trio time) shows nothing running or waiting. A gone engine is idle."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return True
        peers = self.planner.peer_in_flight().get(engine_id, 0)
        polled_after = engine.load.polled_at is not None and engine.load.polled_at > since
        return (engine.in_flight == 0 and peers == 0 and polled_after
                and engine.load.running + engine.load.waiting == 0)
