"""The admin API: engines (add, remove, label, drain, maintenance), the index, the mesh and the autoscaler.

Everything here is for operators and the chaos suite; none of it is on the request path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from gateway import http_app
from gateway.body_limits import LimitsConfig
from gateway.config import ConfigError, EngineConfig, _build
from gateway.fleet import Fleet, SettingError, check_engine_settings
from gateway.openai_errors import ApiError
from gateway.request_body import load_json_object
from gateway.routing import public_engine_name
from index.digest import block_set_digest

ADMIN_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class AdminApi:
    """What the admin API may see and do: the fleet, and narrow views of the mesh and the autoscaler."""

    fleet: Fleet
    limits: LimitsConfig
    mesh_report: Callable[[], dict[str, Any]]
    isolate: Callable[[bool], None]
    autoscaler_report: Callable[[], dict[str, Any]]


def engine_row(fleet: Fleet, engine_id: str) -> dict[str, Any]:
    engine = fleet.engines.get(engine_id)
    assert engine is not None
    return {
        "id": engine.id, "public_name": public_engine_name(engine.id), "url": engine.url,
        "models": sorted(engine.models), "island": engine.config.island,
        "zone": engine.zone, "healthy": engine.healthy, "draining": engine.draining,
        "maintenance": engine.maintenance, "in_flight": engine.in_flight,
        "running": engine.load.running, "waiting": engine.load.waiting, "kv_usage": engine.load.kv_usage,
        "block_size": engine.block_size, "num_blocks": engine.load.num_blocks,
        "event_sources": engine.event_sources, "role": engine.role,
        "kv_protocol": engine.kv_protocol,
    }


async def index_report(fleet: Fleet) -> dict[str, Any]:
    """Per engine, what the index holds (with a digest of its block set) and how fresh it is. Exporting an
    engine's blocks reads all of them (at 4M blocks over 16 engines the whole report held the loop 216 ms), so
    the report lets other tasks run after each engine."""
    now = trio.current_time()
    cache = fleet.planner.cache
    engines = {}
    for engine in fleet.engines.all():
        info = cache.info(engine.id)
        fresh = info.freshness if info else None
        engine_hashes, own_keys = cache.export(engine.id)
        engines[engine.id] = {
            "blocks": len(engine_hashes),
            "digest": block_set_digest(engine_hashes, own_keys),
            "has_events": bool(info and info.has_events),
            "confidence": round(fresh.confidence(now), 4) if fresh else 0.0,
            "last_seq": fresh.last_seq if fresh else None,
            "seconds_since_event": round(now - fresh.last_event_at, 3) if fresh and fresh.last_event_at else None,
            "gaps": fresh.gaps if fresh else 0,
            "lost_batches": fresh.lost_batches if fresh else 0,
            "resets": fresh.resets if fresh else 0,
            "speculative_blocks": cache.approximate.size(engine.id),
            "ingest_behind": bool(fresh and fresh.behind_since is not None),
        }
        await trio.lowlevel.checkpoint()
    return {"engines": engines, "ingest": fleet.ingest.report()}


async def _json_body(api: AdminApi, scope: dict, receive) -> dict[str, Any]:
    """The admin body: a JSON object within the router's limits (an empty body is an empty object)."""
    raw = await http_app.read_body(scope, receive, ADMIN_BODY_BYTES, api.limits.body_timeout_s)
    return load_json_object(raw, api.limits) if raw.strip() else {}


async def handle_admin(api: AdminApi, method: str, path: str, scope: dict, receive, send) -> int:
    fleet = api.fleet
    parts = [p for p in path.split("/") if p][1:]
    if parts == ["index"] and method == "GET":
        await http_app.send_json(send, 200, await index_report(fleet))
        return 200
    if parts == ["mesh"] and method == "GET":
        await http_app.send_json(send, 200, api.mesh_report())
        return 200
    if parts == ["autoscaler"] and method == "GET":
        await http_app.send_json(send, 200, api.autoscaler_report())
        return 200
    if parts == ["mesh", "isolate"] and method == "POST":
        isolated = _flag(await _json_body(api, scope, receive), "isolated")
        api.isolate(isolated)
        await http_app.send_json(send, 200, {"isolated": isolated})
        return 200
    if parts == ["engines"] and method == "GET":
        await http_app.send_json(send, 200, {"engines": [engine_row(fleet, e.id) for e in fleet.engines.all()]})
        return 200
    if parts == ["engines"] and method == "POST":
        body = await _json_body(api, scope, receive)
        try:
            config = _build(EngineConfig, body, "engine")
            config.validate("engine")  # the URL rule is config.validate_engine_url, as for every other source
            engine_id = fleet.add(config)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(":")[0]) from None
        except ValueError as exc:
            raise ApiError(400, f"engine.url: {exc}", param="engine.url") from None
        await http_app.send_json(send, 201, engine_row(fleet, engine_id))
        return 201
    if len(parts) >= 2 and parts[0] == "engines":
        engine_id = parts[1]
        if fleet.engines.get(engine_id) is None:
            raise ApiError(404, f"no engine {engine_id!r}", code="engine_not_found")
        if len(parts) == 2 and method == "DELETE":
            fleet.remove(engine_id)
            await http_app.send_json(send, 200, {"removed": engine_id})
            return 200
        if len(parts) == 2 and method in ("PATCH", "POST"):
            body = await _json_body(api, scope, receive)
            return await _set_state(fleet, engine_id, body, send)
        if len(parts) == 3 and parts[2] == "drain" and method == "POST":
            return await _drain(fleet, engine_id, await _json_body(api, scope, receive), send)
        if len(parts) == 3 and parts[2] == "maintenance" and method == "POST":
            enabled = _flag(await _json_body(api, scope, receive), "enabled")
            return await _set_state(fleet, engine_id, {"maintenance": enabled}, send)
    raise ApiError(404, f"no admin route for {method} {path}", code="not_found")


def _flag(body: dict[str, Any], key: str) -> bool:
    """A boolean setting, true when absent; ``"false"`` is refused rather than read as true."""
    value = body.get(key, True)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false", param=key)
    return value


async def _drain(fleet: Fleet, engine_id: str, body: dict[str, Any], send) -> int:
    """Take the engine out of rotation (``Fleet.drain``). The deadline is this replica's: send the drain to
    every replica."""
    enabled = _flag(body, "enabled")
    deadline = body.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)
                                 or not 0 <= deadline < 86400):
        raise ApiError(400, "'deadline_s' must be a number of seconds from 0 to 86400", param="deadline_s")
    fleet.drain(engine_id, enabled, deadline)
    engine = fleet.engines.get(engine_id)
    assert engine is not None
    row = engine_row(fleet, engine_id)
    row["drain_deadline_in_s"] = None if math.isinf(engine.pool.drain_at) else deadline
    await http_app.send_json(send, 200, row)
    return 200


async def _set_state(fleet: Fleet, engine_id: str, body: dict[str, Any], send) -> int:
    try:
        check_engine_settings(body)
    except SettingError as exc:
        raise ApiError(400, str(exc), param=exc.key) from None
    fleet.set_state(engine_id, body)
    await http_app.send_json(send, 200, engine_row(fleet, engine_id))
    return 200
