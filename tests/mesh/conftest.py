"""A real redis-server per test, on a free loopback port, with nothing written to disk."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from mesh_node_helpers import free_port


@pytest.fixture
def redis_server(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (apt-get install -y redis-server)"
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    client.close()
    yield url, process
    process.kill()
    process.wait()
