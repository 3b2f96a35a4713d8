"""Blocking HTTP helpers for the gateway tests (a module of its own: conftest modules cannot be imported
by name when several test folders have one)."""

import http.client
import json
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
