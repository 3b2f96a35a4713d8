"""How ``kvmesh bench scale`` watches its replicas: ``/metrics`` scrapes, chat and ``/ready`` probes, and
the waits between phases (subscribed, caught up, converged on the publisher's live sets)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from bench.client import TRANSPORT_ERRORS, HttpClient, completion
from bench.replica_stats import EngineGauges, engine_gauges
from bench.scale_fleet import MODEL, Replica
from bench.scale_report import Latency

Scrapes = list[tuple[float, EngineGauges]]

POLL_S = 0.5
"""Scrape interval of each replica's /metrics while measuring: a scrape costs the replica a few ms."""
WAIT_POLL_S = 0.2
"""Poll interval while waiting for replicas to catch up or converge."""
SETTLE_S = 1.0
CHAT_WORKERS = 2
READY_INTERVAL_S = 0.02
PROBE_TIMEOUT_S = 30.0
CATCH_UP_TIMEOUT_S = 120.0


async def scrape(client: HttpClient, replica: Replica, timeout: float = 5.0) -> tuple[float, EngineGauges]:
    with trio.fail_after(timeout):
        response = await client.request(replica.url + "/metrics")
    return time.monotonic(), engine_gauges(response.body.decode())


async def _follow(client: HttpClient, replica: Replica, into: Scrapes) -> None:
    """Scrape ``/metrics`` every POLL_S until cancelled; a scrape that fails is skipped."""
    while True:
        try:
            into.append(await scrape(client, replica))
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
            pass
        await trio.sleep(POLL_S)


async def follow_all(client: HttpClient, reps: list[Replica], scrapes: list[Scrapes]) -> None:
    async with trio.open_nursery() as nursery:
        for replica, into in zip(reps, scrapes, strict=True):
            nursery.start_soon(_follow, client, replica, into)


@asynccontextmanager
async def scraped(client: HttpClient, reps: list[Replica]) -> AsyncIterator[None]:
    """Every replica's ``/metrics`` scraped as often as while publishing, for as long as the block runs (what the
    scrapes read is dropped): an idle spell measured without them would charge them to ingest."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_all, client, reps, [[] for _ in reps])
        yield
        nursery.cancel_scope.cancel()


async def _probe(client: HttpClient, url: str, seconds: float) -> tuple[Latency, Latency]:
    """Chat (one token, CHAT_WORKERS at a time) and ``/ready`` latency through one replica for ``seconds``."""
    until = time.monotonic() + seconds
    chats: list[float] = []
    readies: list[float] = []
    errors = {"chat": 0, "ready": 0}

    async def chat_worker(worker: int) -> None:
        n = 0
        while time.monotonic() < until:
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": f"scale probe {worker}-{n}: say hi"}]}
            result = await completion(client, url + "/v1/chat/completions", body, timeout=PROBE_TIMEOUT_S)
            if result.ok:
                chats.append(result.total)
            else:
                errors["chat"] += 1
            n += 1

    async def ready_worker() -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                with trio.fail_after(PROBE_TIMEOUT_S):
                    ok = (await client.request(url + "/ready")).status == 200
            except (*TRANSPORT_ERRORS, trio.TooSlowError):
                ok = False
            if ok:
                readies.append(time.monotonic() - started)
            else:
                errors["ready"] += 1
            await trio.sleep(READY_INTERVAL_S)

    async with trio.open_nursery() as nursery:
        for worker in range(CHAT_WORKERS):
            nursery.start_soon(chat_worker, worker)
        nursery.start_soon(ready_worker)
    return Latency.of(chats, errors["chat"]), Latency.of(readies, errors["ready"])


async def probe_all(client: HttpClient, reps: list[Replica], seconds: float) -> list[tuple[Latency, Latency]]:
    out: list[tuple[Latency, Latency]] = [(Latency(), Latency())] * len(reps)

    async def one(i: int) -> None:
        out[i] = await _probe(client, reps[i].url, seconds)

    async with trio.open_nursery() as nursery:
        for i in range(len(reps)):
            nursery.start_soon(one, i)
    return out


async def wait_subscribed(client: HttpClient, reps: list[Replica], ids: list[str]) -> None:
    """Until every replica lists every engine as fed by events (then ZMQ gets a moment to connect)."""
    for replica in reps:
        with trio.fail_after(60):
            while True:
                try:
                    report = await client.get_json(replica.url + "/admin/index")
                except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
                    report = {}
                engines = report.get("engines", {}) if isinstance(report, dict) else {}
                if all(engines.get(i, {}).get("has_events") for i in ids):
                    break
                await trio.sleep(0.2)
    await trio.sleep(SETTLE_S)


async def wait_caught_up(client: HttpClient, reps: list[Replica], timeline: dict[str, list[float]],
                         scrapes: list[Scrapes]) -> None:
    """Until every replica applied every published batch (bounded; a replica that never does shows in the
    table as lag and as a failed convergence)."""
    with trio.move_on_after(CATCH_UP_TIMEOUT_S):
        for replica, into in zip(reps, scrapes, strict=True):
            while True:
                try:
                    into.append(await scrape(client, replica))
                    if all(into[-1][1].batches.get(e, 0) >= len(t) for e, t in timeline.items()):
                        break
                except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
                    pass
                await trio.sleep(WAIT_POLL_S)
        return
    print(f"  not every replica caught up within {CATCH_UP_TIMEOUT_S:.0f} s", file=sys.stderr, flush=True)


async def wait_converged(client: HttpClient, replica: Replica, state: dict, ids: list[str], stopped: float,
                         timeout: float, into: Scrapes) -> tuple[bool, float]:
    """Whether the replica's per-engine digests equal the publisher's, and seconds after ``stopped`` until
    they did (inf when they never did within ``timeout``)."""
    blocks = {e: s["blocks"] for e, s in zip(ids, state["engines"], strict=True)}
    digests = {e: s["digest"] for e, s in zip(ids, state["engines"], strict=True)}

    async def equal() -> bool:
        report = await client.get_json(replica.url + "/admin/index", timeout=PROBE_TIMEOUT_S)
        engines = report.get("engines", {}) if isinstance(report, dict) else {}
        return all(engines.get(e, {}).get("digest") == d for e, d in digests.items())

    while time.monotonic() < stopped + timeout:
        try:
            into.append(await scrape(client, replica))
            if into[-1][1].blocks == blocks and await equal():
                return True, time.monotonic() - stopped
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
            pass
        await trio.sleep(WAIT_POLL_S)
    try:
        return await equal(), math.inf
    except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
        return False, math.inf
