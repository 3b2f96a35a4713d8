"""Seeds: parsing, and the Redis seed registry against a real redis-server that is then killed."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
import trio

from mesh.gossip import Membership
from mesh.seeds import RedisSeedRegistry, parse_hostport, parse_seeds
from mesh.settings import MeshSettings

SECRET = b"seed-test-secret-0123456789"


def test_parse_seeds_accepts_lists_and_ipv6_and_rejects_garbage():
    assert parse_seeds(" 127.0.0.1:7947, [::1]:7948 ,") == ["127.0.0.1:7947", "[::1]:7948"]
    assert parse_hostport("[::1]:7948") == ("::1", 7948)
    for bad in ("127.0.0.1", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


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
            config = MeshSettings(
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
