"""``kvmesh up --routers 2 --engines 2`` for real: HAProxy in front, requests through it, restart, down."""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.request
from pathlib import Path

import pytest

from cluster import cli, daemon, haproxy
from cluster.daemon import StartError
from cluster.local import UpOptions, restart, up
from cluster.state import load

pytestmark = pytest.mark.integration

CHAT = {
    "model": "kvmesh-tiny",
    "messages": [{"role": "user", "content": "hello from the cluster"}],
    "max_tokens": 4,
}


def _chat(url: str) -> dict:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(CHAT).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def _chat_requests_served(router_url: str) -> float:
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('kvmesh_requests_total{endpoint="/v1/chat/completions",status="200"')
    )


def _wait_all_up(stats_url: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = haproxy.server_states(stats_url)
        if len(states) == count and set(states.values()) == {"UP"}:
            return
        time.sleep(0.1)
    raise AssertionError(f"backends not all UP: {states}")


def test_up_serve_restart_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    argv = ["up", "--routers", "2", "--engines", "2", "--profile", "fast", "--state-dir", str(state_dir)]
    assert cli.main(argv) == 0
    state = load(state_dir)
    records = state.processes
    try:
        assert [r.role for r in records] == ["engine", "engine", "router", "router", "haproxy"]
        assert all(daemon.alive(r) for r in records)
        assert stat.S_IMODE(Path(state.secret_file).stat().st_mode) == 0o600
        routers = state.by_role("router")
        for router, other in ((routers[0], routers[1]), (routers[1], routers[0])):
            assert router.argv[router.argv.index("--seeds") + 1] == f"127.0.0.1:{other.ports['gossip']}"
            assert [router.argv[i + 1] for i, a in enumerate(router.argv) if a == "--engine"] == [
                e.url for e in state.by_role("engine")
            ]
        assert cli.main(["up", "--routers", "1", "--engines", "1", "--state-dir", str(state_dir)]) == 1

        for _ in range(6):
            assert _chat(state.haproxy_url)["choices"][0]["finish_reason"] == "length"
        assert all(_chat_requests_served(r.url) >= 2 for r in routers), "round robin reaches both replicas"

        victim = routers[0]
        daemon.stop([victim], grace=0)
        assert not daemon.alive(victim)
        assert _chat(state.haproxy_url)["usage"]["completion_tokens"] == 4
        restarted = restart(state_dir, victim.name)
        assert restarted.argv == victim.argv and restarted.pid != victim.pid
        assert load(state_dir).find(victim.name).pid == restarted.pid
        _wait_all_up(state.stats_url, 2)
        records = load(state_dir).processes
    finally:
        code = cli.main(["down", "--state-dir", str(state_dir)])
    assert code == 0
    assert not (state_dir / "cluster.json").exists()
    assert not any(daemon.session_members(r) for r in records)
    assert cli.main(["down", "--state-dir", str(state_dir)]) == 0


def _writing_to(folder: Path) -> list[int]:
    """Pids whose stdout is a log file in ``folder``: every process a cluster start spawned there."""
    pids = []
    for fd in Path("/proc").glob("[0-9]*/fd/1"):
        try:
            if Path(os.readlink(fd)).parent == folder:
                pids.append(int(fd.parts[2]))
        except OSError:
            continue
    return pids


def test_a_failed_start_stops_what_it_started(tmp_path: Path) -> None:
    """The engines start, then the router refuses its flags: up() fails and leaves nothing behind."""
    state_dir = tmp_path / "state"
    options = UpOptions(
        routers=1, engines=2, profile="fast", policy="no-such-policy", state_dir=state_dir, timeout=60
    )
    with pytest.raises(StartError, match="router-0"):
        up(options)
    assert (state_dir / "logs" / "engine-1.log").exists()
    assert _writing_to(state_dir / "logs") == []
    assert not (state_dir / "cluster.json").exists()


def test_routers_started_before_one_failed_are_stopped_too(tmp_path: Path, monkeypatch) -> None:
    """router-1 cannot bind its replication port (the test holds it): up() fails, and router-0, already
    running, is stopped with the engine (before, only the engines were: the router kept running)."""
    import socket

    from cluster import local
    from cluster.ports import free_ports

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = free_ports(4, udp_too=True)
    chosen[3] = taken.getsockname()[1]  # gossip 0-1, replication 2-3: router-1's replication
    monkeypatch.setattr(local, "free_ports", lambda count, udp_too=False: chosen[:count])
    state_dir = tmp_path / "state"
    try:
        with pytest.raises(StartError, match="router-1"):
            up(UpOptions(routers=2, engines=1, profile="fast", state_dir=state_dir, timeout=60))
    finally:
        taken.close()
    assert (state_dir / "logs" / "router-1.log").exists()
    assert _writing_to(state_dir / "logs") == []
