"""Settings and fixtures every test shares."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings

# Property tests check behaviour, not speed: a per-example deadline fails them on a busy 2-core machine
# (a 367 ms example of a 200 ms deadline, with other processes running) without anything being wrong.
settings.register_profile("kvmesh", deadline=None)
settings.load_profile("kvmesh")


def free_port() -> int:
    """A TCP port nothing listens on right now (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real redis-server per test, on a free loopback port, with nothing written to disk."""
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
