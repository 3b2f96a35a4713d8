"""Blocking HTTP helpers for the gateway tests (a module of its own: conftest modules cannot be imported
by name when several test folders have one)."""

import http.client
import json
import time
from urllib.parse import urlsplit

MODEL = "kvmesh-tiny"


class Http:
    """A tiny blocking client: what the tests need to see (status, headers, raw chunks) and nothing more."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname, parts.port

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 30.0):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        payload = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=payload, headers=headers or {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def json(self, method: str, path: str, body=None, headers=None):
        status, head, data = self.request(method, path, body, headers)
        return status, head, json.loads(data) if data else None


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def metric(client: Http, name: str, **labels) -> float:
    """The sum of the samples of ``name`` on a ``/metrics`` page whose labels include ``labels``."""
    _, _, raw = client.request("GET", "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float = 10.0, step: float = 0.1) -> bool:
    """Whether ``predicate`` came true within ``timeout`` seconds, asked every ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())
