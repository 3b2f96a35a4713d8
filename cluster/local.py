"""``kvmesh up`` / ``down``: a local cluster of daemonised processes described by a state file.

Start order: Redis (optional), engines, router replicas (meshed with each other), HAProxy in front.
Each step waits, bounded, until its processes answer; any failure stops what was started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis

from cluster import daemon, haproxy
from cluster.daemon import REPO_ROOT, ProcessRecord, StartError
from cluster.ports import HOST, free_port, free_ports
from cluster.router_config import ClusterKeys, standby_autoscaler, write_router_config
from cluster.state import ClusterState, load
from gateway.server import READY_PREFIX as ROUTER_READY
from sim.cli import READY_PREFIX as SIM_READY

SYSTEM_DEPS = REPO_ROOT / "scripts" / "system_deps.sh"
STANDBY = "standby"
"""Name prefix of the spare engines (``standby-0``, ...): engines the routers are not given."""


class ClusterError(RuntimeError):
    """The cluster could not be started or found; the message says why."""


@contextmanager
def _stopped_on_failure(records: list[ProcessRecord]) -> Iterator[None]:
    """Stop the processes in ``records`` (started so far) when starting the rest fails: ``up`` stops only the
    groups that were returned to it (routers started before one failed kept running after a failed up)."""
    try:
        yield
    except BaseException:
        daemon.stop(records)
        raise


@dataclass(frozen=True)
class UpOptions:
    """What ``kvmesh up`` starts. ``port`` 0 lets the kernel choose HAProxy's port."""

    routers: int = 3
    engines: int = 4
    vllm: bool = False
    redis: bool = False
    port: int = 0
    state_dir: Path = Path(".kvmesh")
    policy: str = "kv_aware"
    mesh: bool = True
    profile: str = "a40-qwen1.5b"
    time_scale: float = 1.0
    num_blocks: int = 4096
    max_num_seqs: int = 64
    timeout: float = 120.0
    standby: int = 0
    """Simulated spare engines the routers' autoscaler provisions through a standby pool (none: no autoscaler)."""
    auth: bool = False
    """Routers with auth: an admin key and the tenants of ``cluster.router_config.TENANTS``."""

    def validate(self) -> None:
        if self.routers < 1 or self.engines < 1:
            raise ClusterError("--routers and --engines must be at least 1")
        if self.standby < 0 or (self.standby and (self.vllm or not self.mesh)):
            raise ClusterError("--standby needs simulated engines and a mesh (the autoscaler's lease)")
        if not 0 <= self.port < 65536:
            raise ClusterError(f"--port {self.port} is not a TCP port")


def ensure_system_programs(names: list[str]) -> None:
    """Install HAProxy / redis-server through the project's script when one is missing."""
    if all(shutil.which(n) for n in names):
        return
    subprocess.run(["bash", str(SYSTEM_DEPS)], check=True, timeout=900)
    missing = [n for n in names if not shutil.which(n)]
    if missing:
        raise ClusterError(f"still missing after {SYSTEM_DEPS.name}: {', '.join(missing)}")


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _start_redis(logs: Path, deadline: float) -> ProcessRecord:
    port = free_port()
    record = daemon.spawn(
        ProcessRecord(
            role="redis",
            name="redis",
            log=str(logs / "redis.log"),
            ports={"port": port},
            url=f"redis://{HOST}:{port}/0",
            argv=["redis-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"],
        )
    )
    client = redis.Redis(host=HOST, port=port, socket_timeout=1)
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return record
        except redis.RedisError:
            if not daemon.alive(record):
                raise StartError(f"redis exited:\n{daemon.log_tail(record)}") from None
        time.sleep(0.05)
    raise StartError(f"redis not answering:\n{daemon.log_tail(record)}")


def _start_sim_engines(options: UpOptions, logs: Path, deadline: float) -> list[ProcessRecord]:
    """One process per engine, so that chaos can kill or pause a single engine; the standby engines
    (``STANDBY``-i) start beside them, at the same time."""
    records: list[ProcessRecord] = []
    with _stopped_on_failure(records):
        _spawn_sim_engines(options, logs, records, options.engines, "engine")
        _spawn_sim_engines(options, logs, records, options.standby, STANDBY)
        for record in records:
            _pin_sim_engine(record, deadline)
    return records


def _spawn_sim_engines(options: UpOptions, logs: Path, records: list[ProcessRecord], count: int, prefix: str) -> None:
    for i in range(count):
        argv = _python(
            "sim.cli",
            "--engines",
            "1",
            "--base-port",
            "0",
            "--profile",
            options.profile,
            "--time-scale",
            str(options.time_scale),
            "--num-blocks",
            str(options.num_blocks),
            "--max-num-seqs",
            str(options.max_num_seqs),
        )
        records.append(
            daemon.spawn(
                ProcessRecord(role="engine", name=f"{prefix}-{i}", argv=argv, log=str(logs / f"{prefix}-{i}.log"))
            )
        )


def _pin_sim_engine(record: ProcessRecord, deadline: float) -> None:
    """Wait for the engine's ports and pin the ones the kernel chose, so a restart comes back where the routers
    look for it."""
    info = daemon.wait_ready_line(record, SIM_READY, deadline)[0]
    record.url = info["url"]
    record.ports = {"http": info["port"], "events": info["event_port"], "replay": info["replay_port"]}
    base = record.argv.index("--base-port")
    record.argv[base : base + 2] = [
        "--base-port",
        str(info["port"]),
        "--event-base-port",
        str(info["event_port"]),
        "--replay-base-port",
        str(info["replay_port"]),
    ]
    daemon.wait_http_ok(record, record.url + "/health", deadline)


def _start_vllm_engines(options: UpOptions, logs: Path, deadline: float) -> list[ProcessRecord]:
    from cluster import vllm_engine

    vllm_engine.install()
    planned = vllm_engine.plan_engines(options.engines, vllm_engine.EngineOptions(log_dir=logs), "engine")
    records: list[ProcessRecord] = []
    for engine in planned:
        # The record owns the process from here on; the engine object only knew how to build its command.
        extra_env = {k: v for k, v in engine.environment().items() if os.environ.get(k) != v}
        record = ProcessRecord(
            role="engine",
            name=engine.name,
            argv=engine.command(),
            log=str(engine.log_path),
            url=engine.url,
            env=extra_env,
            cwd=str(logs),
            ports={"http": engine.port, "events": engine.events_port, "replay": engine.replay_port},
        )
        records.append(daemon.spawn(record))
    with _stopped_on_failure(records):
        for record in records:
            daemon.wait_http_ok(record, f"{record.url}/health", deadline)
    return records


def router_argv(
    options: UpOptions,
    engines: list[str],
    port: int,
    gossip: list[int],
    replication: list[int],
    index: int,
    secret_file: Path,
    redis_url: str | None,
    config: Path | None = None,
) -> list[str]:
    """Router ``index``'s command line: it seeds its gossip with every other replica's address."""
    args = ["router", "--host", HOST, "--port", str(port), "--policy", options.policy]
    if config is not None:
        args += ["--config", str(config)]
    for url in engines:
        args += ["--engine", url]
    if options.mesh:
        seeds = ",".join(f"{HOST}:{p}" for i, p in enumerate(gossip) if i != index)
        args += [
            "--mesh-bind",
            f"{HOST}:{gossip[index]}",
            "--mesh-secret-file",
            str(secret_file),
            "--replication-bind",
            f"{HOST}:{replication[index]}",
        ]
        if seeds:
            args += ["--seeds", seeds]
        if redis_url:
            args += ["--redis-url", redis_url]
    return _python("gateway.cli", *args)


def _start_routers(
    options: UpOptions,
    engines: list[str],
    logs: Path,
    secret_file: Path,
    redis_url: str | None,
    deadline: float,
    config: Path | None = None,
) -> list[ProcessRecord]:
    """Start every router; each binds its HTTP port itself (0) and reports it, so no other process can take
    it between a choice and the bind (a shared machine did, once). Gossip and replication ports are chosen
    here, since each router's seeds are the others'. A failure stops the routers already started."""
    n = options.routers
    ports = free_ports(2 * n, udp_too=True)
    gossip, replication = ports[:n], ports[n:]
    records: list[ProcessRecord] = []
    with _stopped_on_failure(records):
        for i in range(n):
            argv = router_argv(options, engines, 0, gossip, replication, i, secret_file, redis_url, config)
            records.append(
                daemon.spawn(
                    ProcessRecord(
                        role="router",
                        name=f"router-{i}",
                        argv=argv,
                        log=str(logs / f"router-{i}.log"),
                        ports={"gossip": gossip[i], "replication": replication[i]},
                    )
                )
            )
        for record in records:
            record.url = daemon.wait_ready_line(record, ROUTER_READY, deadline)["url"]
            record.ports["http"] = int(urlsplit(record.url).port or 0)
            # Pin the port it bound, so a restart comes back where HAProxy looks for it.
            at = record.argv.index("--port")
            record.argv[at + 1] = str(record.ports["http"])
            daemon.wait_http_ok(record, f"{record.url}/ready", deadline)
    return records


def _start_haproxy(
    options: UpOptions, routers: list[ProcessRecord], state_dir: Path, logs: Path, deadline: float
) -> ProcessRecord:
    port = options.port or free_port()
    stats_port = free_port()
    config = state_dir / "haproxy.cfg"
    servers = [(r.name, f"{HOST}:{r.ports['http']}") for r in routers]
    config.write_text(haproxy.render(f"{HOST}:{port}", f"{HOST}:{stats_port}", servers=servers))
    haproxy.check(config)
    argv = ["haproxy", "-db", "-f", str(config)]
    record = daemon.spawn(
        ProcessRecord(
            role="haproxy",
            name="haproxy",
            argv=argv,
            log=str(logs / "haproxy.log"),
            url=f"http://{HOST}:{port}",
            ports={"port": port, "stats": stats_port},
        )
    )
    stats_url = f"http://{HOST}:{stats_port}/stats"
    while time.monotonic() < deadline:
        if not daemon.alive(record):
            raise StartError(f"haproxy exited:\n{daemon.log_tail(record)}")
        try:
            states = haproxy.server_states(stats_url)
        except (OSError, KeyError):
            states = {}
        if len(states) == len(routers) and all(s == "UP" for s in states.values()):
            return record
        time.sleep(0.1)
    raise StartError(f"haproxy backends not all UP in time:\n{daemon.log_tail(record)}")


def _write_secret(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")


def _write_router_config(options: UpOptions, state: ClusterState, engines: int, spares: list[str]) -> Path | None:
    """The routers' TOML when they run an autoscaler or auth (None otherwise); records the pool and key files."""
    if not spares and not options.auth:
        return None
    state_dir = Path(state.state_dir)
    tables: dict[str, dict[str, object]] = {}
    arrays: dict[str, list[dict[str, object]]] = {}
    if spares:
        state.pool_file = str(state_dir / "pool.json")
        Path(state.pool_file).unlink(missing_ok=True)
        tables["autoscaler"], arrays["autoscaler.offers"] = standby_autoscaler(
            options.routers, engines, spares, Path(state.pool_file))
    if options.auth:
        keys = ClusterKeys.generate()
        state.keys_file = str(keys.save(state_dir / "keys.json"))
        tables["auth"], arrays["tenants"] = keys.tables()
    return write_router_config(state_dir / "router.toml", {}, tables, arrays)


def running(state_dir: Path) -> ClusterState | None:
    """The state of a cluster that still has a live process there, else None."""
    try:
        state = load(state_dir)
    except (FileNotFoundError, ValueError):
        return None
    return state if any(daemon.alive(p) for p in state.processes) else None


def up(options: UpOptions) -> ClusterState:
    """Start everything, wait until HAProxy sees every router UP, write the state file."""
    options.validate()
    state_dir = options.state_dir.resolve()
    if running(state_dir):
        raise ClusterError(f"a cluster is already running from {state_dir}; run 'kvmesh down' first")
    ensure_system_programs(["haproxy", "redis-server"] if options.redis else ["haproxy"])
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    secret_file = state_dir / "mesh.secret"
    _write_secret(secret_file)
    state = ClusterState(
        state_dir=str(state_dir),
        haproxy_url="",
        stats_url="",
        policy=options.policy,
        meshed=options.mesh,
        secret_file=str(secret_file),
    )
    deadline = time.monotonic() + options.timeout
    try:
        if options.redis:
            state.processes.append(_start_redis(logs, deadline))
            state.redis_url = state.processes[-1].url
        start_engines = _start_vllm_engines if options.vllm else _start_sim_engines
        state.processes += start_engines(options, logs, deadline)
        engines = [e for e in state.by_role("engine") if not e.name.startswith(STANDBY)]
        spares = [e for e in state.by_role("engine") if e.name.startswith(STANDBY)]
        config = _write_router_config(options, state, len(engines), [s.url or "" for s in spares])
        state.save()
        routers = _start_routers(
            options, [e.url or "" for e in engines], logs, secret_file, state.redis_url, deadline, config
        )
        state.processes += routers
        state.save()
        proxy = _start_haproxy(options, routers, state_dir, logs, deadline)
        state.processes.append(proxy)
        state.haproxy_url = proxy.url or ""
        state.stats_url = f"http://{HOST}:{proxy.ports['stats']}/stats"
        state.save()
    except BaseException:
        daemon.stop(list(reversed(state.processes)))
        _remove_state(state_dir)
        raise
    return state


def _remove_state(state_dir: Path) -> None:
    for name in ("cluster.json", "cluster.tmp", "mesh.secret", "haproxy.cfg", "router.toml", "keys.json", "pool.json"):
        (state_dir / name).unlink(missing_ok=True)


def down(state_dir: Path, grace: float = 10.0) -> list[ProcessRecord]:
    """Stop every process of the cluster (front to back) and remove the state; returns the survivors.

    Logs stay in ``state_dir/logs`` for a post-mortem."""
    state = load(state_dir.resolve())
    survivors = daemon.stop(list(reversed(state.processes)), grace)
    if not survivors:
        _remove_state(state_dir.resolve())
    return survivors


def restart(state_dir: Path, name: str, deadline_s: float = 60.0) -> ProcessRecord:
    """Start a (killed) process again with the same command, ports and environment; updates the state."""
    state = load(state_dir.resolve())
    record = state.find(name)
    daemon.stop([record])
    daemon.spawn(record)
    deadline = time.monotonic() + deadline_s
    if record.role == "router":
        daemon.wait_ready_line(record, ROUTER_READY, deadline)
        daemon.wait_http_ok(record, f"{record.url}/ready", deadline)
    elif record.role == "engine" and record.url:
        daemon.wait_http_ok(record, record.url + "/health", deadline)
    state.save()
    return record
