"""Mesh nodes in separate processes (python -m mesh.node): one is kill -9ed, the others drop it from their view."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

pytestmark = [pytest.mark.integration, pytest.mark.mesh]

REPO = Path(__file__).resolve().parents[2]
DETECTION_BOUND_S = 3.0


class NodeProcess:
    """One ``python -m mesh.node`` process and the JSON lines it printed so far."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[dict] = []

    async def read(self) -> None:
        buffer = b""
        async for chunk in self.process.stdout:
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            self.lines += [json.loads(line) for line in complete]

    @property
    def ready(self) -> dict:
        return self.lines[0]

    def view(self) -> dict | None:
        return next((x for x in reversed(self.lines) if x["event"] == "view"), None)


async def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.05)


async def start(nursery: trio.Nursery, name: str, secret_file: Path, seeds: str = "") -> NodeProcess:
    argv = [sys.executable, "-m", "mesh.node", "--name", name, "--mesh-secret-file", str(secret_file),
            "--seeds", seeds, "--duration", "60"]
    node = NodeProcess(await trio.lowlevel.open_process(argv, cwd=REPO, stdout=subprocess.PIPE))
    nursery.start_soon(node.read)
    await wait_for(lambda: bool(node.lines), 20)
    return node


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "mesh.secret"
    path.write_text("node-process-secret-0123456789\n")
    return path


async def test_survivors_drop_a_killed_node_from_their_view_within_3s(secret_file):
    async with trio.open_nursery() as nursery:
        nodes = [await start(nursery, "p0", secret_file)]
        for i in (1, 2):
            nodes.append(await start(nursery, f"p{i}", secret_file, nodes[0].ready["gossip"]))
        try:

            def settled(group: list[NodeProcess]) -> bool:
                views = [n.view() for n in group]
                return all(v is not None and v["live"] == sorted(m.ready["id"] for m in group) for v in views)

            await wait_for(lambda: settled(nodes), 20)
            victim, survivors = nodes[0], nodes[1:]
            killed_at = time.monotonic()
            os.kill(victim.process.pid, signal.SIGKILL)
            await wait_for(lambda: settled(survivors), 10)
            took = max(n.view()["t"] for n in survivors) - killed_at
            print(f"killed node left every view after {took:.2f}s")
            assert took <= DETECTION_BOUND_S
        finally:
            for n in nodes:
                if n.process.returncode is None:
                    n.process.kill()
            with trio.move_on_after(10) as scope:
                scope.shield = True
                for n in nodes:
                    await n.process.wait()
