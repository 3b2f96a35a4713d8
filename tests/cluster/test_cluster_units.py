"""Pieces of the local cluster that need no cluster: HAProxy config, state file, process sessions, argv."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster import daemon, haproxy
from cluster.cli import engines_arg
from cluster.daemon import ProcessRecord
from cluster.local import ClusterError, UpOptions, router_argv
from cluster.state import ClusterState, load
from cluster.vllm_engine import EngineFailed, EngineOptions, VllmEngine


def test_rendered_config_passes_haproxy_check(tmp_path: Path) -> None:
    text = haproxy.render(
        "127.0.0.1:18080",
        "127.0.0.1:18081",
        servers=[("router-0", "127.0.0.1:1"), ("router-1", "127.0.0.1:2")],
    )
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    haproxy.check(config)
    for line in (
        "mode tcp",
        "balance roundrobin",
        "option httpchk GET /ready",
        "http-check expect status 200",
        "inter 500ms fall 2 rise 1",
        "timeout client 600s",
        "timeout server 600s",
        "server router-1 127.0.0.1:2 check",
    ):
        assert line in text


def test_haproxy_check_reports_invalid_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.cfg"
    config.write_text("defaults\n    mode tcp\n    no-such-keyword 1\n")
    with pytest.raises(ValueError, match="haproxy rejects"):
        haproxy.check(config)


def test_render_needs_exactly_one_server_source() -> None:
    with pytest.raises(ValueError):
        haproxy.render("a:1", "a:2")
    with pytest.raises(ValueError):
        haproxy.render("a:1", "a:2", servers=[("r", "a:3")], dns="router:8000")


@pytest.mark.parametrize(
    ("text", "expected"), [("4", (4, False)), ("sim:2", (2, False)), ("vllm:3", (3, True))]
)
def test_engines_argument(text: str, expected: tuple[int, bool]) -> None:
    assert engines_arg(text) == expected


@pytest.mark.parametrize("text", ["", "gpu:2", "vllm:", "vllm:x", "-1"])
def test_engines_argument_rejects_garbage(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        engines_arg(text)


@given(st.integers(min_value=1, max_value=8), st.booleans())
def test_each_router_seeds_every_other_router_and_never_itself(n: int, with_redis: bool) -> None:
    gossip = [20000 + i for i in range(n)]
    replication = [30000 + i for i in range(n)]
    redis_url = "redis://127.0.0.1:6379/0" if with_redis else None
    for i in range(n):
        argv = router_argv(
            UpOptions(routers=n), ["http://e:1"], 10000 + i, gossip, replication, i, Path("secret"), redis_url
        )
        seeds = argv[argv.index("--seeds") + 1].split(",") if "--seeds" in argv else []
        assert sorted(seeds) == sorted(f"127.0.0.1:{p}" for j, p in enumerate(gossip) if j != i)
        assert argv[argv.index("--mesh-bind") + 1] == f"127.0.0.1:{gossip[i]}"
        assert argv[argv.index("--replication-bind") + 1] == f"127.0.0.1:{replication[i]}"
        assert ("--redis-url" in argv) == with_redis


def test_unmeshed_routers_get_no_mesh_flags() -> None:
    argv = router_argv(
        UpOptions(routers=2, mesh=False), ["http://e:1"], 1, [2, 3], [4, 5], 0, Path("s"), None
    )
    assert not any(a.startswith(("--mesh", "--seeds", "--replication")) for a in argv)


def test_routers_get_the_config_kvmesh_up_wrote_and_standby_needs_a_simulated_mesh() -> None:
    argv = router_argv(UpOptions(routers=3, standby=2), ["http://e:1"], 1, [2, 3, 4], [5, 6, 7], 0, Path("s"), None,
                       Path("state/router.toml"))
    assert argv[argv.index("--config") + 1] == "state/router.toml"
    UpOptions(standby=2, auth=True).validate()
    for options in (UpOptions(standby=1, vllm=True), UpOptions(standby=1, mesh=False), UpOptions(standby=-1)):
        with pytest.raises(ClusterError, match="--standby"):
            options.validate()


def test_state_round_trip_and_malformed(tmp_path: Path) -> None:
    record = ProcessRecord(
        role="router",
        name="router-0",
        argv=["x", "--port", "1"],
        log="l",
        pid=5,
        start_ticks=7,
        url="http://127.0.0.1:1",
        ports={"http": 1},
    )
    state = ClusterState(
        state_dir=str(tmp_path),
        haproxy_url="http://h",
        stats_url="http://s",
        policy="kv_aware",
        meshed=True,
        secret_file="f",
        processes=[record],
    )
    state.save()
    assert load(tmp_path) == state
    assert load(tmp_path).find("router-0").argv == ["x", "--port", "1"]
    (tmp_path / "cluster.json").write_text('{"state_dir": 1}')
    with pytest.raises(ValueError):
        load(tmp_path)


def _sh(tmp_path: Path, script: str) -> ProcessRecord:
    return daemon.spawn(
        ProcessRecord(role="t", name="t", argv=["sh", "-c", script], log=str(tmp_path / "t.log"))
    )


def test_stop_ends_the_whole_session_even_after_the_leader_died(tmp_path: Path) -> None:
    record = _sh(tmp_path, "sleep 300 & sleep 300 & wait")
    deadline = time.monotonic() + 10
    while len(daemon.session_members(record)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    members = daemon.session_members(record)
    assert len(members) == 3
    subprocess.run(["kill", "-KILL", str(record.pid)], check=True)
    deadline = time.monotonic() + 10
    while daemon.alive(record) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not daemon.alive(record)
    assert len(daemon.session_members(record)) == 2
    assert daemon.stop([record], grace=5) == []
    assert daemon.session_members(record) == []


def test_stop_kills_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    record = _sh(tmp_path, "trap '' TERM; echo 'ARMED {}'; while true; do sleep 0.1; done")
    daemon.wait_ready_line(record, "ARMED ", time.monotonic() + 10)
    assert daemon.stop([record], grace=0.5) == []
    assert not daemon.alive(record)


def test_a_recycled_pid_is_never_signalled() -> None:
    me = os.getpid()
    record = ProcessRecord(role="t", name="me", argv=[], log="", pid=me, start_ticks=1)
    assert not daemon.alive(record)
    assert me not in daemon.session_members(record)
    assert daemon.stop([record], grace=0.1) == []


def test_ready_line_of_the_latest_start_only(tmp_path: Path) -> None:
    log = tmp_path / "r.log"
    log.write_text('=== kvmesh: starting r ===\nREADY {"n": 1}\n')
    record = daemon.spawn(
        ProcessRecord(
            role="t",
            name="r",
            log=str(log),
            argv=[sys.executable, "-c", "print('READY {\"n\": 2}', flush=True);import time; time.sleep(30)"],
        )
    )
    try:
        assert daemon.wait_ready_line(record, "READY ", time.monotonic() + 20) == {"n": 2}
    finally:
        daemon.stop([record])


def test_a_dead_child_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    record = _sh(tmp_path, "echo boom >&2; exit 3")
    with pytest.raises(daemon.StartError, match="boom"):
        daemon.wait_ready_line(record, "READY ", time.monotonic() + 20)


def test_a_process_whose_main_thread_exited_is_alive_while_another_thread_runs(tmp_path: Path) -> None:
    """Its open files (a router's listening socket) stay open until the last thread exits."""
    script = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,)).start()\n"
        "print('ARMED {}', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    record = daemon.spawn(
        ProcessRecord(role="t", name="t", argv=[sys.executable, "-c", script], log=str(tmp_path / "t.log"))
    )
    daemon.wait_ready_line(record, "ARMED ", time.monotonic() + 10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the main thread did not exit"
        time.sleep(0.02)
    assert daemon.alive(record)
    assert daemon.session_members(record) == [record.pid]
    assert daemon.stop([record], grace=5) == []
    assert not daemon.alive(record)


class _PortTakingEngine(VllmEngine):
    """Stands in for vLLM where ports are concerned: it binds its events port as vLLM does, exits 1 with
    vLLM's message when that port is taken, and otherwise answers /health on its HTTP port."""

    def command(self) -> list[str]:
        script = (
            "import http.server, socket, sys\n"
            "s = socket.socket()\n"
            "try:\n"
            f"    s.bind(('127.0.0.1', {self.events_port}))\n"
            "except OSError:\n"
            "    print('zmq.error.ZMQError: Address already in use', flush=True)\n"
            "    sys.exit(1)\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {self.port}), H).serve_forever()\n"
        )
        return [sys.executable, "-c", script]


def test_an_engine_whose_port_was_taken_meanwhile_starts_again_on_fresh_ports(tmp_path: Path) -> None:
    engine = _PortTakingEngine(name="e", cpu=0, options=EngineOptions(log_dir=tmp_path, startup_timeout=20))
    taken = engine.events_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        try:
            engine.start()
            engine.wait_ready()
            assert engine.relaunches == 1 and engine.events_port != taken
        finally:
            engine.stop()


def test_an_engine_that_fails_otherwise_is_not_started_again(tmp_path: Path) -> None:
    engine = _PortTakingEngine(name="e", cpu=0, options=EngineOptions(log_dir=tmp_path, startup_timeout=20))
    engine.command = lambda: [sys.executable, "-c", "import sys; print('some other error'); sys.exit(1)"]
    engine.start()
    with pytest.raises(EngineFailed, match="some other error"):
        engine.wait_ready()
    assert engine.relaunches == 0
