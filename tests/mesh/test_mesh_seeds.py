"""Seeds: parsing, and the Redis seed registry against a real redis-server that is then killed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import trio

from mesh.gossip import Membership, MeshConfig
from mesh.seeds import RedisSeedRegistry, parse_hostport, parse_seeds

SECRET = b"seed-test-secret-0123456789"


def test_parse_seeds_accepts_lists_and_ipv6_and_rejects_garbage():
    assert parse_seeds(" 127.0.0.1:7947, [::1]:7948 ,") == ["127.0.0.1:7947", "[::1]:7948"]
    assert parse_hostport("[::1]:7948") == ("::1", 7948)
    for bad in ("127.0.0.1", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (apt-get install -y redis-server)"
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
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


@pytest.mark.integration
def test_registry_publishes_discovers_expires_and_withdraws(redis_server):
    url, _ = redis_server
    a = RedisSeedRegistry(url, "c1", "a", ttl=0.3)
    b = RedisSeedRegistry(url, "c1", "b", ttl=30)
    other = RedisSeedRegistry(url, "c2", "x", ttl=30)
    a.publish("127.0.0.1:1")
    b.publish("127.0.0.1:2")
    other.publish("127.0.0.1:3")
    redis.Redis.from_url(url).set("kvmesh:seeds:c1:junk", "not an address")
    assert a.discover() == ["127.0.0.1:1", "127.0.0.1:2"]
    b.withdraw()
    deadline = time.monotonic() + 5
    while a.discover() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.discover() == []
    for r in (a, b, other):
        r.close()


async def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


@pytest.mark.integration
async def test_members_find_each_other_through_redis_and_survive_its_death(redis_server):
    url, process = redis_server
    async with trio.open_nursery() as nursery:
        members = []
        for i in range(3):
            config = MeshConfig(
                secret=SECRET, name=f"r{i}", bind="127.0.0.1:0", redis_url=url, redis_seed_ttl=0.6
            )
            members.append(await nursery.start(Membership(config).run))
        everyone = {m.member_id for m in members}
        await wait_for(lambda: all({x.id for x in m.live_members()} == everyone for m in members), 10)
        process.kill()
        await trio.to_thread.run_sync(process.wait)
        await wait_for(lambda: all(m.stats["redis_errors"] >= 2 for m in members), 10)
        await members[2].leave()
        rest = {m.member_id for m in members[:2]}
        await wait_for(lambda: all({x.id for x in m.live_members()} == rest for m in members[:2]), 2)
        await trio.sleep(1.0)
        assert all({x.id for x in m.live_members()} == rest for m in members[:2])
        nursery.cancel_scope.cancel()
