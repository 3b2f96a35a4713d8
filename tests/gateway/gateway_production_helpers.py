"""Shared by the production gateway tests: config files with tenants, metric reads, polling, held streams."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from bench.engine_stats import parse_counters
from gateway.security.keys import generate_key, hash_key

T = TypeVar("T")
HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
SUCCESSES = "vllm:request_success_total"


def new_keys(*names: str) -> dict[str, str]:
    """A fresh random key per name (tenant or "admin"), never written anywhere in plain text."""
    return {name: generate_key() for name in names}


def write_config(path: Path, keys: dict[str, str], tenants: list[dict[str, Any]], **sections: Any) -> str:
    """A router TOML file: auth on, the admin key (keys["admin"]) and tenants whose keys come from ``keys``.

    ``sections`` are extra tables (``admission={...}``) or top-level settings (``first_byte_timeout_s=1``).
    """
    lines = [f"{k} = {json.dumps(v)}" for k, v in sections.items() if not isinstance(v, dict)]
    lines += ["[auth]", "enabled = true", f"admin_keys = [{json.dumps(hash_key(keys['admin']))}]"]
    for name, table in sections.items():
        if isinstance(table, dict):
            lines += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    for tenant in tenants:
        lines += ["[[tenants]]", f"name = {json.dumps(tenant['name'])}",
                  f"keys = [{json.dumps(hash_key(keys[tenant['name']]))}]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in tenant.items() if k != "name"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def bearer(key: str, **extra: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}", **extra}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def engine_counter(url: str, name: str) -> float:
    """One metric of one engine, summed over its label sets."""
    return parse_counters(scrape(url), (name,))[name]


def breaker_state(router_url: str, engine_id: str) -> int | None:
    match = re.search(rf'^kvmesh_engine_breaker_state{{engine="{re.escape(engine_id)}"}} (\S+)$',
                      scrape(router_url), re.MULTILINE)
    return None if match is None else int(float(match.group(1)))


def engine_id(url: str) -> str:
    """The router's id for an engine given by URL (host:port, see gateway.engines.engine_id_for)."""
    return urlsplit(url).netloc


def set_fault(url: str, **fault: Any) -> None:
    """``POST /sim/fault``; a dying engine closes the connection instead of answering."""
    request = urllib.request.Request(url + "/sim/fault", data=json.dumps(fault).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    except (http.client.RemoteDisconnected, ConnectionResetError):
        if not fault.get("die"):
            raise


def wait_until(predicate: Callable[[], T], timeout: float, step: float = 0.1) -> T:
    """Poll until ``predicate()`` is truthy (returns it) or the timeout passes (returns the last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def served_by(route: str) -> str:
    """The engine that answered, from an ``x-kvmesh-route`` header (``served_by`` after a failover)."""
    fields = dict(part.strip().split("=", 1) for part in route.split(";") if "=" in part)
    return fields.get("served_by", fields.get("engine", ""))


def open_stream(base_url: str, body: dict[str, Any], headers: dict[str, str]) -> socket.socket:
    """Send a request on a raw socket and leave the answer unread: an in-flight request the test owns.

    Closing the socket is a client disconnect."""
    parts = urlsplit(base_url)
    payload = json.dumps(body).encode()
    head = ["POST /v1/chat/completions HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(payload)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    return sock
