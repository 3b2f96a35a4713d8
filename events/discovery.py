"""What an engine says about itself: its models (GET /v1/models) and event endpoints (config, or its
GET /kv_event_sources).

Both answers come from outside the process, so the parsers here are pure functions that either return
a well-formed value or raise ValueError: never TypeError, RecursionError or UnicodeError, which would
otherwise escape into the engine's background tasks.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from events.curve import check_z85_key

log = logging.getLogger("kvmesh.events")

_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}
_HOST = re.compile(r"^[A-Za-z0-9._:%*\[\]-]*$")
MAX_RANK = 4096
"""Data-parallel ranks above this are not a real deployment; their port offset would leave the port range."""
MAX_MODEL_ID_CHARS = 1024


def load_json(body: bytes | str) -> Any:
    """json.loads that fails only with ValueError (deep nesting raises RecursionError in the stdlib)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@dataclass(frozen=True)
class ModelList:
    """What an engine's ``GET /v1/models`` says: its model ids, the longest context they report, its adapters."""

    ids: set[str]
    max_model_len: int | None
    """vLLM's ``max_model_len``; None unless every entry gives a sane one."""
    adapters: dict[str, str]
    """LoRA adapter -> base model: vLLM lists each adapter served with ``--lora-modules`` as its own entry
    whose ``parent`` is the base model's id (the base's is null). An entry whose parent is not listed, or
    is itself, is not taken for an adapter."""


def parse_models(body: bytes | str) -> ModelList:
    """An OpenAI ``GET /v1/models`` answer (``{"data": [{"id": ...}, ...]}``), parsed once.

    Entries that are not objects with a string id are skipped; anything else is a ValueError. A server
    still loading its model may answer ``"data": null``: that is "no models yet", not an error.
    """
    data = load_json(body)
    if not isinstance(data, dict):
        raise ValueError("/v1/models must answer a JSON object")
    models = data.get("data")
    if models is None:
        return ModelList(set(), None, {})
    if not isinstance(models, list):
        raise ValueError(f"/v1/models: data must be a list, got {type(models).__name__}")
    cards = [m for m in models if isinstance(m, dict) and _is_model_id(m.get("id"))]
    # vLLM lists a LoRA adapter with "max_model_len": null; the context is its base model's.
    lengths = [m.get("max_model_len") for m in cards if m.get("max_model_len") is not None or not m.get("parent")]
    sane = lengths and all(type(n) is int and 0 < n <= MAX_MODEL_LEN for n in lengths)
    ids = {m["id"] for m in cards}
    adapters = {m["id"]: m["parent"] for m in cards
                if isinstance(m.get("parent"), str) and m["parent"] in ids and m["parent"] != m["id"]}
    return ModelList(ids, max(lengths) if sane else None, adapters)


MAX_MODEL_LEN = 1 << 30


def _is_model_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_MODEL_ID_CHARS and value.isprintable()


def check_topic(topic: Any) -> str:
    """A ZMQ subscription topic: a string that encodes to UTF-8 (a lone surrogate does not)."""
    if not isinstance(topic, str):
        raise ValueError(f"event topic must be a string, got {type(topic).__name__}")
    try:
        topic.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"event topic {topic!r} is not valid UTF-8") from None
    return topic


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one publisher (one data-parallel rank) can be reached; the router always connects to it.

    Built only with values the subscriber can use: a bad one raises ValueError here, not inside the
    subscriber task.
    """

    endpoint: str
    replay_endpoint: str | None
    topic: str
    rank: int = 0
    curve_server_key: str | None = None
    """The publisher's CURVE public key (Z85): the router connects as a CURVE client (events/curve.py)."""

    def __post_init__(self) -> None:
        check_topic(self.topic)
        if self.curve_server_key is not None:
            check_z85_key(self.curve_server_key, "curve_server_key")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not (isinstance(endpoint, str) and endpoint.isascii()):
                raise ValueError(f"event endpoint {endpoint!r} must be an ASCII string")
        if not 0 <= self.rank <= MAX_RANK:
            raise ValueError(f"data-parallel rank {self.rank} is not in 0..{MAX_RANK}")


def _split_tcp(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    if not _HOST.match(host) or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    return host, int(port)


def _format(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def resolve_endpoint(endpoint: str, engine_host: str, rank: int) -> tuple[str, bool]:
    """(where to connect, whether the engine's PUB connects out): a wildcard host becomes the engine's
    host; vLLM offsets each data-parallel rank's port by its rank.

    A PUB whose endpoint names a concrete host connects out to that one address. The router does not
    bind it for the engine (whoever could reach a bound port could publish blocks in the engine's name,
    and only one replica could bind it): it connects there as to any publisher and reports the engine
    as publishing in connect mode."""
    host, port = _split_tcp(endpoint)
    if not 0 < port + rank <= 65535:
        raise ValueError(f"endpoint {endpoint!r} of rank {rank} is outside the port range")
    wildcard = host in _WILDCARDS
    return _format(engine_host if wildcard else host, port + rank), not wildcard


def _rank(key: str) -> int:
    if not (key.isascii() and key.isdigit() and str(int(key)) == key and int(key) <= MAX_RANK):
        raise ValueError(f"kv_event_sources: rank {key!r} is not an integer in 0..{MAX_RANK}")
    return int(key)


def parse_kv_event_sources(body: bytes | str | dict[str, Any], engine_url: str) -> list[EventSource]:
    """Parse the engine's /kv_event_sources answer; ranks with events off or a non-zmq publisher are skipped.

    Raises ValueError on anything that is not the documented shape.
    """
    data = load_json(body) if isinstance(body, bytes | str) else body
    if not isinstance(data, dict):
        raise ValueError("kv_event_sources must be a JSON object")
    engine_host = urlsplit(engine_url).hostname or "127.0.0.1"
    sources = []
    for rank, config in sorted(((_rank(key), value) for key, value in data.items()), key=lambda item: item[0]):
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq":
            continue
        endpoint = config.get("endpoint")
        replay = config.get("replay_endpoint")
        if not isinstance(endpoint, str) or not isinstance(replay, str | None):
            raise ValueError(f"kv_event_sources: rank {rank} endpoints must be strings")
        endpoint, connects_out = resolve_endpoint(endpoint, engine_host, rank)
        if connects_out:
            log.warning("engine publishes KV events in connect mode; start it with a tcp://*:PORT endpoint so "
                        "router replicas can subscribe", extra={"engine": engine_url[:200], "endpoint": endpoint})
        replay_endpoint = resolve_endpoint(replay, engine_host, rank)[0] if replay else None
        topic = config.get("topic") or ""
        sources.append(EventSource(endpoint, replay_endpoint, check_topic(topic), rank))
    return sources
