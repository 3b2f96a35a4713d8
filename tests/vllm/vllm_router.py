"""Talking to a kvmesh router that fronts real vLLM engines: routed chats, the route header, the debug and
admin endpoints, per-request prefix-cache hits read from the engines' own counters, tenant configs.

Every wait polls for a condition under a deadline: events and metrics reach the router and the engines'
counters a moment after the response, and the machine is shared.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from vllm_wire import get_text

from bench.engine_stats import parse_counters
from cluster.vllm_engine import SERVED_MODEL_NAME, VllmEngine
from gateway.routing import public_engine_name
from gateway.security.keys import hash_key

T = TypeVar("T")
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
WAIT_S = 30.0


def engine_id(engine: VllmEngine) -> str:
    """The router's id for an engine given by URL: its host:port."""
    return urlsplit(engine.url).netloc


def wait_until(predicate: Callable[[], T], timeout: float = WAIT_S, step: float = 0.05) -> T:
    """The first truthy value of ``predicate()``; fails the test when the deadline passes first."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"condition not met within {timeout} s (last value {value!r})"
        time.sleep(step)
    return value


def route_fields(header: str) -> dict[str, str]:
    """``engine=a; overlap=64/100; ...`` as a dict."""
    return dict(part.strip().split("=", 1) for part in header.split(";") if "=" in part)


@dataclass(frozen=True)
class Routed:
    """One answered chat: who served it, what the router predicted, what the engine reported."""

    status: int
    route: dict[str, str]
    body: dict[str, Any]

    @property
    def served_by(self) -> str:
        return self.route.get("served_by", self.route.get("engine", ""))

    @property
    def predicted_overlap(self) -> int:
        return int(self.route["overlap"].split("/")[0])

    @property
    def routed_prompt_tokens(self) -> int:
        return int(self.route["overlap"].split("/")[1])

    @property
    def prompt_tokens(self) -> int:
        return self.body["usage"]["prompt_tokens"]


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0} | extra


def user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


class RouterClient:
    """A blocking client for one router, optionally presenting an API key."""

    def __init__(self, url: str, key: str | None = None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.key = key

    def _request(self, method: str, path: str, body: dict[str, Any] | None, key: str | None,
                 timeout: float = 60.0) -> tuple[int, dict[str, str], dict[str, Any]]:
        headers = {"content-type": "application/json"}
        if key or self.key:
            headers["authorization"] = f"Bearer {key or self.key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            response = conn.getresponse()
            raw = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(raw or b"{}")
        finally:
            conn.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
        """Any POST, answered as (status, headers, JSON body)."""
        return self._request("POST", path, body, None)

    def chat(self, messages: list[dict[str, Any]], **extra: Any) -> Routed:
        body = chat_body(messages, **extra)
        status, headers, body = self._request("POST", "/v1/chat/completions", body, None)
        assert status == 200, f"router answered {status}: {body}"
        return Routed(status, route_fields(headers["x-kvmesh-route"]), body)

    def debug_route(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The router's scoring of ``messages``; waits out the endpoint's rate limit as a client should."""
        deadline = time.monotonic() + WAIT_S
        while True:
            status, headers, body = self._request("POST", "/debug/route", chat_body(messages, **extra), None)
            if status != 429 or time.monotonic() > deadline:
                break
            time.sleep(float(headers.get("retry-after", "1")))
        assert status == 200, f"/debug/route answered {status}: {body}"
        return body

    def overlaps(self, messages: list[dict[str, Any]]) -> dict[str, int]:
        """Exact overlap (tokens) per candidate engine, as the router would see it now."""
        rows = self.debug_route(messages)["candidates"]
        return {row["engine"]: row["overlap_exact_tokens"] for row in rows}

    def engines(self) -> list[dict[str, Any]]:
        status, _, body = self._request("GET", "/admin/engines", None, None)
        assert status == 200, f"/admin/engines answered {status}: {body}"
        return body["engines"]

    def index(self, admin_key: str | None = None) -> dict[str, dict[str, Any]]:
        status, _, body = self._request("GET", "/admin/index", None, admin_key)
        assert status == 200, f"/admin/index answered {status}: {body}"
        return body["engines"]


def counters(engine: VllmEngine) -> dict[str, float]:
    """Prefix-cache hits and queries (tokens) from one scrape of the engine's /metrics."""
    return parse_counters(get_text(engine, "/metrics"), (HITS, QUERIES))


@dataclass
class HitMeter:
    """Reads, per routed request, how many prompt tokens the serving engine took from its prefix cache.

    The engine records a request's queries and hits together a moment after answering: waiting for the
    queries counter to grow by the request's prompt tokens makes the hits reading complete."""

    engines: dict[str, VllmEngine]

    def send(self, client: RouterClient, messages: list[dict[str, Any]], **extra: Any) -> tuple[Routed, int]:
        before = {name: counters(engine) for name, engine in self.engines.items()}
        routed = client.chat(messages, **extra)
        # An admin is told the engine's id, a tenant its public name.
        name = next(n for n in self.engines if routed.served_by in (n, public_engine_name(n)))
        engine = self.engines[name]
        start = before[name]
        queried = start[QUERIES] + routed.prompt_tokens
        after = wait_until(lambda: (now := counters(engine))[QUERIES] >= queried and now)
        return routed, int(after[HITS] - start[HITS])


def write_tenant_config(path: Path, admin_key: str, tenant_keys: dict[str, str]) -> Path:
    """A router TOML with auth on, one admin key and one isolated tenant per entry (only key hashes)."""
    lines = ["[auth]", "enabled = true", f"admin_keys = [{json.dumps(hash_key(admin_key))}]"]
    for name, key in tenant_keys.items():
        lines += ["[[tenants]]", f"name = {json.dumps(name)}", f"keys = [{json.dumps(hash_key(key))}]",
                  'cache = "isolated"']
    path.write_text("\n".join(lines) + "\n")
    return path
