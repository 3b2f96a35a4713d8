"""Event endpoints of an engine: from config, or learned from its GET /kv_event_sources."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one publisher (one data-parallel rank) can be reached.

    `bind` is True when the engine's PUB connects out (its endpoint names a concrete host), so the
    router must bind that address instead of connecting to it.
    """

    endpoint: str
    replay_endpoint: str | None
    topic: str
    rank: int = 0
    bind: bool = False


def _split_tcp(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    return host, int(port)


def _format(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def resolve_endpoint(endpoint: str, engine_host: str, rank: int) -> tuple[str, bool]:
    """Wildcard host -> the engine's host; vLLM offsets each data-parallel rank's port by its rank."""
    host, port = _split_tcp(endpoint)
    wildcard = host in _WILDCARDS
    return _format(engine_host if wildcard else host, port + rank), not wildcard


def parse_kv_event_sources(body: bytes | str | dict[str, Any], engine_url: str) -> list[EventSource]:
    """Parse the engine's /kv_event_sources answer; ranks with events off or a non-zmq publisher are skipped.

    Raises ValueError on anything that is not the documented shape.
    """
    data = json.loads(body) if isinstance(body, bytes | str) else body
    if not isinstance(data, dict):
        raise ValueError("kv_event_sources must be a JSON object")
    engine_host = urlsplit(engine_url).hostname or "127.0.0.1"
    sources = []
    for rank_key, config in sorted(data.items(), key=lambda item: int(item[0])):
        rank = int(rank_key)
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq":
            continue
        endpoint, bind = resolve_endpoint(str(config["endpoint"]), engine_host, rank)
        replay = config.get("replay_endpoint")
        replay_endpoint = resolve_endpoint(str(replay), engine_host, rank)[0] if replay else None
        sources.append(EventSource(endpoint, replay_endpoint, str(config.get("topic") or ""), rank, bind))
    return sources
