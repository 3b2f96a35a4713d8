"""The processes of one ``kvmesh bench scale`` cell: Redis, the synthetic publisher, R meshed replicas.

Replicas are real ``kvmesh router`` processes started from a configuration file that names every engine
with explicit ``events``/``replay`` endpoints (the synthetic publisher) and an HTTP ``url`` (a simulated
engine that answers health, metrics and chat), meshed with a shared secret, each other as gossip seeds,
and Redis on.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import trio

from bench.client import HttpClient
from bench.processes import REPO_ROOT, StartFailed, python_module, spawned, stop, wait_ready
from bench.runner import wait_meshed
from cluster.local import ensure_system_programs
from cluster.ports import HOST, free_port, free_ports
from sim.cli import READY_PREFIX as SIM_READY

MODEL = "kvmesh-tiny"
"""The simulated engines' served model: the routers key every engine's blocks under it."""


@dataclass(frozen=True)
class EngineEndpoints:
    id: str
    url: str
    events: str
    replay: str
    topic: str = "kv"


@dataclass(frozen=True)
class Replica:
    url: str
    pid: int


def _toml(value: object) -> str:
    """A TOML value for the strings, numbers and string lists of a router config (JSON spells them alike)."""
    return json.dumps(value)


def replica_config(port: int, engines: Sequence[EngineEndpoints], model: str, gossip: list[int], index: int,
                   secret_file: Path, redis_url: str, cluster: str, ingest_process: bool = False) -> str:
    """Router ``index``'s configuration file: every engine, and a mesh seeded with the other replicas."""
    seeds = [f"{HOST}:{p}" for i, p in enumerate(gossip) if i != index]
    lines = [f"host = {_toml(HOST)}", f"port = {port}", 'policy = "kv_aware"', 'log_level = "warning"',
             f"ingest_process = {'true' if ingest_process else 'false'}", "",
             "[mesh]", f"bind = {_toml(f'{HOST}:{gossip[index]}')}", f"seeds = {_toml(seeds)}",
             f"secret_file = {_toml(str(secret_file))}", f"redis_url = {_toml(redis_url)}",
             f"cluster = {_toml(cluster)}"]
    for e in engines:
        lines += ["", "[[engines]]", f"id = {_toml(e.id)}", f"url = {_toml(e.url)}", f"model = {_toml(model)}",
                  f"events = {_toml(e.events)}", f"replay = {_toml(e.replay)}", f"topic = {_toml(e.topic)}"]
    return "\n".join(lines) + "\n"


@asynccontextmanager
async def redis_server(log_dir: Path) -> AsyncIterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    ensure_system_programs(["redis-server"])
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    log = log_dir / "redis.log"
    async with spawned(argv, log) as proc:
        client = redis.Redis(host=HOST, port=port, socket_timeout=1)
        with trio.move_on_after(10):
            while proc.returncode is None:
                try:
                    if await trio.to_thread.run_sync(client.ping):
                        break
                except redis.RedisError:
                    await trio.sleep(0.05)
        client.close()
        if proc.returncode is not None:
            raise StartFailed(f"redis-server exited with {proc.returncode} (see {log})")
        yield f"redis://{HOST}:{port}/0"


class LineProcess:
    """A child whose stdout is read line by line and whose stdin takes commands."""

    def __init__(self, proc: trio.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self._buffer = b""

    async def line(self) -> bytes:
        assert self.proc.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.proc.stdout.receive_some(1 << 20)
            if not chunk:
                raise StartFailed(f"{self.name} exited ({self.proc.returncode})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


@asynccontextmanager
async def line_process(argv: list[str], log: Path, name: str) -> AsyncIterator[LineProcess]:
    """Run ``argv`` (stderr to ``log``) for the block; closing its stdin, then SIGTERM, stops it."""
    with log.open("wb") as err:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=str(REPO_ROOT),
            start_new_session=True,
        )  # fmt: skip
    try:
        yield LineProcess(proc, name)
    finally:
        with trio.CancelScope(shield=True):
            assert proc.stdin is not None
            await proc.stdin.aclose()
            await stop(proc)


@asynccontextmanager
async def sim_engines(client: HttpClient, count: int, log_dir: Path, num_blocks: int) -> AsyncIterator[list[str]]:
    """``count`` simulated engines (profile ``fast``, events off: the synthetic publisher sends them) on
    ports the kernel picks, so nothing else on the machine can take one first; yields their URLs. Each
    reports ``num_blocks`` of KV capacity: the router bounds an engine's index by its reported capacity,
    so it must hold the synthetic engine's cap."""
    argv = python_module("sim.cli", "--engines", str(count), "--base-port", "0", "--profile", "fast", "--no-events",
                         "--num-blocks", str(num_blocks))
    log = log_dir / f"sim-{free_port()}.log"
    async with line_process(argv, log, "kvmesh sim") as sim:
        with trio.fail_after(60):
            while not (line := (await sim.line()).decode()).startswith(SIM_READY):
                pass
        urls = [str(engine["url"]) for engine in json.loads(line.removeprefix(SIM_READY))]
        for url in urls:
            await wait_ready(client, url + "/health", sim.proc, log)
        yield urls


class Publisher:
    """The synthetic publisher process (bench/synthetic_publisher.py), driven by its line commands."""

    def __init__(self, process: LineProcess) -> None:
        self.process = process

    async def command(self, text: str) -> dict[str, Any]:
        assert self.process.proc.stdin is not None
        await self.process.proc.stdin.send_all(text.encode() + b"\n")
        answer = json.loads(await self.process.line())
        if "error" in answer:
            raise StartFailed(f"synthetic publisher: {answer['error']}")
        return answer


class Publishers:
    """Several publisher processes playing one fleet, each its own share of the engines, driven as one: a
    ``run`` or ``fill`` splits the rate by engine share, the answers merge in engine order.

    One process spent ~6.4 us of CPU per block op (generating the mix, ZeroMQ, pacing), so it tops out near
    150k ops/s on a core of its own; the sweep's higher rates need more than one."""

    def __init__(self, parts: list[Publisher], shares: list[int]) -> None:
        self.parts = parts
        self.shares = shares

    async def command(self, text: str) -> dict[str, Any]:
        words = text.split()
        total = sum(self.shares)
        answers: list[dict[str, Any]] = [{} for _ in self.parts]

        async def one(i: int) -> None:
            command = text
            if words[0] in ("run", "fill", "prepare"):
                command = f"{words[0]} {float(words[1]) * self.shares[i] / total} {words[2]}"
            answers[i] = await self.parts[i].command(command)

        async with trio.open_nursery() as nursery:
            for i in range(len(self.parts)):
                nursery.start_soon(one, i)
        return merged_answers(answers)


def merged_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer for the whole fleet from its publishers' answers (each in its engines' order)."""
    if "engines" in answers[0]:
        return {"engines": [engine for a in answers for engine in a["engines"]]}
    if "prepared_ops" in answers[0]:
        return {"prepared_ops": sum(a["prepared_ops"] for a in answers), "batches": sum(a["batches"] for a in answers),
                "seconds": max(a["seconds"] for a in answers)}
    seconds = max(a["seconds"] for a in answers)
    ops = sum(a["ops"] for a in answers)
    return {"ops": ops, "stored": sum(a["stored"] for a in answers), "removed": sum(a["removed"] for a in answers),
            "full": all(a["full"] for a in answers), "seconds": seconds,
            "ops_per_s": ops / seconds if seconds > 0 else 0.0, "behind_s": max(a["behind_s"] for a in answers),
            "first_seq": [seq for a in answers for seq in a["first_seq"]],
            "times": [times for a in answers for times in a["times"]], "bytes": sum(a["bytes"] for a in answers)}


@asynccontextmanager
async def publisher(args: Sequence[str], log_dir: Path, engines: int,
                    processes: int = 1) -> AsyncIterator[tuple[Publishers, list[dict[str, str]]]]:
    """Start ``processes`` publisher processes sharing ``engines`` engines; yields them as one and the engines'
    endpoints in engine order."""
    shares = [engines // processes + (i < engines % processes) for i in range(processes)]
    async with AsyncExitStack() as stack:
        parts, endpoints, first = [], [], 0
        for share in shares:
            argv = python_module("bench.synthetic_publisher", *args, "--engines", str(share),
                                 "--first-engine", str(first))
            log = log_dir / f"publisher-{free_port()}.log"
            process = await stack.enter_async_context(line_process(argv, log, "synthetic publisher"))
            with trio.fail_after(30):
                endpoints += json.loads(await process.line())["engines"]
            parts.append(Publisher(process))
            first += share
        yield Publishers(parts, shares), endpoints


def _secret(log_dir: Path) -> Path:
    path = log_dir / f"mesh-{free_port()}.secret"
    path.write_text(os.urandom(24).hex())
    path.chmod(0o600)
    return path


@asynccontextmanager
async def replicas(client: HttpClient, count: int, engines: Sequence[EngineEndpoints], model: str,
                   redis_url: str, cluster: str, log_dir: Path,
                   ingest_process: bool = False) -> AsyncIterator[list[Replica]]:
    """``count`` meshed router replicas, ready and seeing each other; stopped on exit."""
    ports = free_ports(2 * count, udp_too=True)
    http, gossip = ports[:count], ports[count:]
    secret = _secret(log_dir)
    async with AsyncExitStack() as stack:
        started = []
        for i in range(count):
            config = log_dir / f"{cluster}-router-{i}.toml"
            config.write_text(replica_config(http[i], engines, model, gossip, i, secret, redis_url, cluster,
                                             ingest_process))
            log = log_dir / f"{cluster}-router-{i}.log"
            argv = python_module("gateway.cli", "router", "--config", str(config))
            started.append((await stack.enter_async_context(spawned(argv, log)), log, f"http://{HOST}:{http[i]}"))
        for proc, log, url in started:
            await wait_ready(client, url + "/ready", proc, log)
        urls = [url for _, _, url in started]
        if count > 1:
            await wait_meshed(client, urls)
        yield [Replica(url, proc.pid) for proc, _, url in started]
