"""Engine URLs are checked wherever they enter, and failures of an engine's tasks are episodes: counted every
time, logged once, backed off, and they keep the engine out of rotation until the task succeeds again."""

from __future__ import annotations

import logging

import pytest
import trio
from prometheus_client import REGISTRY
from untrusted_engines import serve_canned

from gateway.breaker import EngineHealth
from gateway.config import ConfigError, EngineConfig, validate_engine_url
from gateway.engine_faults import EngineFaults, supervise
from gateway.engines import EngineRegistry
from gateway.upstream import EnginePool, UpstreamError


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "https://engine-a.example:443/", "http://[::1]:80",
                                 "http://xn--bcher-kva.example"])
def test_plain_http_urls_are_accepted(url):
    assert validate_engine_url(url) == url


@pytest.mark.parametrize(("url", "why"), [
    ("http://\u00fc@10.0.0.5:8000", "ASCII"), ("http://b\u00fccher.example", "ASCII"),
    ("http://user:pw@10.0.0.5:8000", "user:password"), ("ftp://10.0.0.5", "http"), ("http://", "http"),
    ("http://10.0.0.5:0", "port"), ("http://10.0.0.5:70000", "URL"), ("http://10.0.0.5:x", "URL"),
    ("http://10.0.0.5 :80", "printable"), ("http://10.0.0.5\r\n:80", "printable"),
])
def test_urls_the_pool_cannot_use_are_refused_with_the_reason(url, why):
    with pytest.raises(ValueError, match=why):
        validate_engine_url(url)


def test_the_config_and_the_registry_use_the_same_rule():
    with pytest.raises(ConfigError, match=r"engines\[2\]\.url: .*ASCII"):
        EngineConfig(url="http://\u00fc@10.0.0.5:8000").validate("engines[2]")
    with pytest.raises(ConfigError, match=r"engines\[0\]\.topic: .*UTF-8"):
        EngineConfig(url="http://10.0.0.5:8000", topic="\udc80").validate("engines[0]")  # as os.environ may hold
    registry = EngineRegistry()
    with pytest.raises(ValueError, match="ASCII"):
        registry.add(EngineConfig(url="http://\u00fc@10.0.0.5:8000", id="x"))
    assert registry.all() == []


def failures(engine: str, task: str, reason: str) -> float:
    labels = {"engine": engine, "task": task, "reason": reason}
    return REGISTRY.get_sample_value("kvmesh_engine_task_failures_total", labels) or 0.0


def test_a_failure_episode_is_logged_once_counted_each_time_and_backs_off(caplog):
    health = EngineHealth()
    health.record_health(True)
    faults = EngineFaults("episode", health, base_s=0.25, max_s=1.0)
    with caplog.at_level(logging.INFO, logger="kvmesh.engines"):
        delays = [faults.failed("discovery", TypeError("bad")) for _ in range(5)]
        assert not health.routable(0.0) and "discovery failing: TypeError" in health.reason(0.0)
        faults.succeeded("discovery")
        faults.succeeded("discovery")
        faults.failed("discovery", TypeError("again"))
    assert delays == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert failures("episode", "discovery", "TypeError") == 6
    failed, recovered = "engine task failed; retrying with backoff", "engine task recovered"
    assert [r.getMessage() for r in caplog.records] == [failed, recovered, failed]
    faults.succeeded("discovery")
    assert health.routable(0.0)


async def test_supervise_reruns_a_task_after_any_exception_but_lets_cancellation_through():
    faults = EngineFaults("supervised", EngineHealth(), base_s=0.01, max_s=0.01)
    runs = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RecursionError("deep")
        faults.succeeded("t")

    await supervise(faults, "t", flaky)
    assert len(runs) == 3 and failures("supervised", "t", "RecursionError") == 2 and not faults.failing

    async def forever() -> None:
        await trio.sleep_forever()

    with trio.move_on_after(0.05) as scope:
        await supervise(faults, "t", forever)
    assert scope.cancelled_caught


async def test_a_poll_answer_over_the_limit_is_an_upstream_error_not_a_buffer():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_canned, {"/metrics": b"x" * 5000, "/health": b"{}"})
        pool = EnginePool(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamError, match="4096 byte limit"):
            await pool.get("/metrics", max_bytes=4096)
        assert await pool.get("/health", max_bytes=4096) == (200, b"{}")
        nursery.cancel_scope.cancel()
