"""The benchmark's fork server: forked children behave as ``python -m`` children do, for ``spawned``'s callers."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from bench import zygote
from bench.client import HttpClient
from bench.processes import free_port_range, python_module, spawned, stop, wait_ready

pytestmark = pytest.mark.integration


async def test_forked_fleet_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    client = HttpClient()
    try:
        async with zygote.running(tmp_path):
            base = free_port_range(2, (0, 1000, 2000))
            argv = python_module("sim.cli", "--engines", "2", "--base-port", str(base))
            async with spawned(argv, tmp_path / "sim.log", cores=frozenset({0})) as proc:
                assert isinstance(proc, zygote.ForkedProcess)
                await wait_ready(client, f"http://127.0.0.1:{base + 1}/health", proc, tmp_path / "sim.log")
                assert proc.returncode is None
                assert os.getsid(proc.pid) == proc.pid  # its own session, as start_new_session gives
                assert os.sched_getaffinity(proc.pid) == {0}
                assert Path(f"/proc/{proc.pid}/cwd").resolve() == Path(zygote.__file__).resolve().parents[1]
            assert proc.returncode == 0  # sim exits 0 on SIGTERM
    finally:
        await client.aclose()


async def test_exit_codes_and_log_reach_the_client(tmp_path: Path) -> None:
    async with zygote.running(tmp_path):
        async with spawned(python_module("sim.cli", "--engines", "0"), tmp_path / "bad.log") as bad:
            assert await bad.wait() == 2
        log = (tmp_path / "bad.log").read_text()
        assert "engines, block size" in log and "Warning" not in log
        async with spawned(python_module("sim.cli", "--engines", "1", "--base-port", "0"),
                           tmp_path / "k.log") as killed:
            killed.kill()
            assert await killed.wait() == -signal.SIGKILL


async def test_other_children_start_fresh(tmp_path: Path) -> None:
    """Modules not preloaded, or another environment, are not forked."""
    async with zygote.running(tmp_path):
        argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
        async with spawned(argv, tmp_path / "c.log") as proc:
            assert isinstance(proc, trio.Process)
            assert await proc.wait() == 3
        async with spawned(python_module("sim.cli", "--engines", "0"), tmp_path / "e.log", env=dict(os.environ)) as p:
            assert isinstance(p, trio.Process)
            await stop(p)


async def test_server_ends_with_its_client(tmp_path: Path) -> None:
    async with zygote.running(tmp_path) as server:
        path = server.path
    with trio.fail_after(10):
        while True:
            try:
                s = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
                await s.connect("\0" + path)
            except OSError:
                break
            s.close()
            await trio.sleep(0.1)
