"""Peer routers in the same comparison: ``smg:POLICY`` in a policy list starts SGLang's Shepherd Model
Gateway (``pip install smg`` into its own venv) in front of the same kind of fresh fleet as kvmesh's
rows, so the peer's row comes from the same run on the same machine.

The binary is ``$SMG_BINARY`` or ``smg`` on PATH (not a ``KVMESH_*`` variable: kvmesh routers started in
the same run read those as their configuration and refuse unknown keys). Its replicas are independent,
as smg's are without its own mesh.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from bench.client import HttpClient
from bench.processes import StartFailed, free_port_range, spawned, wait_ready

SMG_PREFIX = "smg:"


def is_peer(policy: str) -> bool:
    return policy.startswith(SMG_PREFIX)


SMG_GRACE_S = 0.5
"""smg drains for 5 s after SIGTERM and exits about 7 s after it; a benchmark sends nothing more by then, and
waiting out the drain cost a routing suite 6 s per shape."""


def smg_binary() -> str:
    found = os.environ.get("SMG_BINARY") or shutil.which("smg")
    if not found:
        raise StartFailed("smg is not installed: `python -m venv smg-venv && smg-venv/bin/pip install smg`, "
                          "then put smg-venv/bin on PATH or set SMG_BINARY to its smg")
    return found


def smg_argv(binary: str, policy: str, engine_urls: list[str], port: int, metrics_port: int) -> list[str]:
    """``smg launch`` on loopback with its metrics on a port of its own (its default, 29000, is shared)."""
    return [binary, "launch", "--worker-urls", *engine_urls, "--policy", policy.removeprefix(SMG_PREFIX),
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


@asynccontextmanager
async def smg_router(client: HttpClient, engine_urls: list[str], policy: str, log_dir: Path,
                     pids: dict[str, int] | None = None, cores: frozenset[int] | None = None) -> AsyncIterator[str]:
    """One smg process in front of the engines (it reads the model from their /v1/models), on ``cores`` when
    given; yields its URL (and notes its pid in ``pids``, by URL)."""
    port = free_port_range(2)
    metrics_port = port + 1
    argv = smg_argv(smg_binary(), policy, engine_urls, port, metrics_port)
    log = log_dir / f"smg-{policy.removeprefix(SMG_PREFIX)}-{port}.log"
    async with spawned(argv, log, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cores=cores, grace=SMG_GRACE_S) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(client, url + "/v1/models", proc, log)
        if pids is not None:
            pids[url] = proc.pid
        yield url
