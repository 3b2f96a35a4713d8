"""HAProxy in front of the router replicas: one template for the local cluster and for docker compose."""

from __future__ import annotations

import csv
import io
import subprocess
import urllib.request
from pathlib import Path

import jinja2

TEMPLATE = Path(__file__).with_name("haproxy.cfg.jinja")


def render(
    bind: str,
    stats_bind: str,
    servers: list[tuple[str, str]] | None = None,
    dns: str | None = None,
    stats_socket: str | None = None,
    origin: str = "kvmesh up",
) -> str:
    """The config for fixed ``servers`` ``[(name, "host:port")]``, or replicas found by ``dns`` name:port."""
    if (servers is None) == (dns is None):
        raise ValueError("give either servers or a DNS name, not both")
    template = jinja2.Template(
        TEMPLATE.read_text(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    return template.render(
        bind=bind,
        stats_bind=stats_bind,
        servers=servers or [],
        dns=dns,
        stats_socket=stats_socket,
        origin=origin,
    )


def check(config: Path) -> None:
    """``haproxy -c``: raises ValueError with HAProxy's own message when the config is invalid."""
    result = subprocess.run(
        ["haproxy", "-c", "-q", "-f", str(config)], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise ValueError(f"haproxy rejects {config}: {(result.stdout + result.stderr).strip()}")


def server_states(stats_url: str, backend: str = "routers") -> dict[str, str]:
    """Each server's status ("UP", "DOWN", ...) from the stats page's CSV export."""
    with urllib.request.urlopen(stats_url + ";csv", timeout=2) as response:
        text = response.read().decode().lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {
        row["svname"]: row["status"]
        for row in rows
        if row.get("pxname") == backend and row["svname"] not in ("FRONTEND", "BACKEND")
    }
