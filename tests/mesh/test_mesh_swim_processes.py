"""Members in separate processes (python -m mesh.gossip) on loopback: kill -9, SIGSTOP/SIGCONT, leave."""

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

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DETECTION_BOUND = 3.0


class Member:
    """One ``python -m mesh.gossip`` process and the JSON lines it printed so far."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[dict] = []
        self.id = ""
        self.addr = ""

    async def read(self) -> None:
        buffer = b""
        async for chunk in self.process.stdout:
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                self.lines.append(json.loads(line))

    def first(self, event: str, member: str) -> dict | None:
        return next((x for x in self.lines if x["event"] == event and x.get("member") == member), None)

    def last_state(self, member: str) -> str | None:
        kinds = [x["event"] for x in self.lines if x.get("member") == member]
        return kinds[-1] if kinds else None


async def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.05)


async def start(nursery: trio.Nursery, name: str, secret_file: Path, seeds: str = "") -> Member:
    argv = [sys.executable, "-m", "mesh.gossip", "--name", name, "--mesh-secret-file", str(secret_file)]
    argv += ["--seeds", seeds, "--duration", "60"]
    process = await trio.lowlevel.open_process(argv, cwd=REPO, stdout=subprocess.PIPE)
    member = Member(process)
    nursery.start_soon(member.read)
    await wait_for(lambda: bool(member.lines), 20)
    member.id, member.addr = member.lines[0]["id"], member.lines[0]["addr"]
    return member


async def cluster(nursery: trio.Nursery, secret_file: Path, n: int) -> list[Member]:
    members = [await start(nursery, "p0", secret_file)]
    for i in range(1, n):
        members.append(await start(nursery, f"p{i}", secret_file, members[0].addr))
    everyone = {m.id for m in members}
    await wait_for(
        lambda: all(
            {x["member"] for x in m.lines if x["event"] == "joined"} == everyone - {m.id} for m in members
        ),
        15,
    )
    return members


async def stop_all(members: list[Member]) -> None:
    for m in members:
        if m.process.returncode is None:
            m.process.kill()
    with trio.move_on_after(10) as scope:
        scope.shield = True
        for m in members:
            await m.process.wait()


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "mesh.secret"
    path.write_text("process-test-secret-0123456789\n")
    return path


async def test_killed_member_is_declared_dead_by_all_survivors_within_3s(secret_file):
    async with trio.open_nursery() as nursery:
        members = await cluster(nursery, secret_file, 4)
        try:
            victim, survivors = members[1], [members[0], *members[2:]]
            killed_at = time.monotonic()
            os.kill(victim.process.pid, signal.SIGKILL)
            await wait_for(lambda: all(s.first("dead", victim.id) for s in survivors), 10)
            delays = [s.first("dead", victim.id)["t"] - killed_at for s in survivors]
            print("detection delays", [round(d, 2) for d in delays])
            assert max(delays) <= DETECTION_BOUND
        finally:
            await stop_all(members)


async def test_paused_member_is_suspected_and_rejoins_when_resumed(secret_file):
    async with trio.open_nursery() as nursery:
        members = await cluster(nursery, secret_file, 3)
        try:
            sleeper, others = members[2], members[:2]
            os.kill(sleeper.process.pid, signal.SIGSTOP)
            await wait_for(lambda: all(o.first("suspect", sleeper.id) for o in others), 10)
            await wait_for(lambda: all(o.first("dead", sleeper.id) for o in others), 10)
            os.kill(sleeper.process.pid, signal.SIGCONT)
            await wait_for(lambda: all(o.last_state(sleeper.id) == "alive" for o in others), 10)
            alive = [x for x in others[0].lines if x.get("member") == sleeper.id and x["event"] == "alive"]
            assert alive[-1]["incarnation"] > 0
        finally:
            await stop_all(members)


async def test_sigterm_leaves_gracefully_and_wrong_secret_is_counted(secret_file, tmp_path):
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-cluster-secret-987654321\n")
    async with trio.open_nursery() as nursery:
        members = await cluster(nursery, secret_file, 3)
        intruder = await start(nursery, "intruder", wrong, members[0].addr)
        try:
            await trio.sleep(1.0)
            members[2].process.send_signal(signal.SIGTERM)
            await wait_for(lambda: all(m.first("left", members[2].id) for m in members[:2]), 5)
            for m in (members[0], members[1], intruder):
                m.process.send_signal(signal.SIGTERM)
            await wait_for(lambda: all(m.lines[-1]["event"] == "stats" for m in (members[0], intruder)), 10)
            seed_stats = members[0].lines[-1]
            assert seed_stats["auth_failures"] >= 1
            assert not any(x.get("member") == intruder.id for m in members for x in m.lines)
            assert intruder.lines[-1]["live"] == []
        finally:
            await stop_all([*members, intruder])
