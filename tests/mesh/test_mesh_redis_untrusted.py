"""Redis is untrusted: snapshots and seed entries are sealed with the mesh secret, bounded, and anything that
fails to verify, parse or load is skipped with a counted reason; the replica starts cold, nothing raises."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import redis
import trio
from doc_replica import Replica

from mesh.crdt_doc import Epoch
from mesh.seeds import RedisSeedRegistry, SeedRejected, open_entry, run_seed_registry, seal_entry
from mesh.snapshots import (
    KEY_PREFIX,
    RedisSnapshotStore,
    Snapshot,
    SnapshotRejected,
    load_into,
    open_fields,
    seal_fields,
)
from mesh.sync_protocol import SyncProtocol

SECRET = b"redis-test-secret-0123456789"
KEY = KEY_PREFIX + "c1"


def stored(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {key.encode(): value for key, value in fields.items()}


def sealed_snapshot(key: str = KEY, secret: bytes = SECRET, **changes: bytes) -> dict[bytes, bytes]:
    index = Replica("a")
    index.store("engine-1", [(1, 7)])
    fields = Snapshot.of(index.doc, 123.0).to_fields()
    fields["mac"] = seal_fields(secret, key, fields)
    fields.update(changes)
    return stored(fields)


def reason(call) -> str:
    with pytest.raises(SnapshotRejected) as info:
        call()
    return info.value.reason


def test_a_sealed_snapshot_opens_and_any_change_to_it_is_refused():
    assert open_fields(SECRET, KEY, sealed_snapshot()).epoch == Epoch(0, "")
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(epoch_number=b"7"))) == "mac"
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(full=b"other"))) == "mac"
    # the base epoch decides how the snapshot merges: it was outside the seal before
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(base_epoch_number=b"7"))) == "mac"
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(base_epoch_owner=b"x"))) == "mac"
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(key=KEY_PREFIX + "c2"))) == "mac"
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(secret=b"another-secret-0123456789"))) == "mac"
    unsealed = sealed_snapshot()
    del unsealed[b"mac"]
    assert reason(lambda: open_fields(SECRET, KEY, unsealed)) == "unsealed"


@pytest.mark.parametrize("number", [str(2**63).encode(), str(2**64).encode(), b"-1", b"1" * 5000, b"1e3"])
def test_epoch_numbers_that_would_not_fit_a_frame_are_refused(number):
    fields = sealed_snapshot()
    fields[b"epoch_number"] = number
    with pytest.raises(ValueError):
        Snapshot.from_fields(fields)
    assert reason(lambda: open_fields(None, KEY, fields)) == "malformed"


def test_a_sealed_snapshot_ages():
    """Before, a genuine sealed snapshot stayed loadable forever: written back into Redis a day later it
    brought back the engines and blocks of an earlier life of the mesh."""
    assert open_fields(SECRET, KEY, sealed_snapshot(), now=123.0 + 60).written_at == 123.0
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(), now=123.0 + 86400)) == "stale"
    assert reason(lambda: open_fields(SECRET, KEY, sealed_snapshot(), now=123.0 - 3600)) == "stale"


def test_a_non_finite_write_time_is_refused():
    with pytest.raises(ValueError):
        Snapshot.from_fields(sealed_snapshot(written_at=b"nan"))


class FakeStore:
    def __init__(self, answer) -> None:
        self.answer = answer

    def load(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_a_rejected_snapshot_is_counted_and_the_replica_starts_cold():
    stats: Counter[str] = Counter()
    protocol = SyncProtocol(Replica("b").doc)
    assert not await load_into(FakeStore(SnapshotRejected("mac", "forged")), protocol, stats)
    assert stats["snapshot_rejected_mac"] == 1 and stats["snapshot_rejected"] == 1


async def test_a_snapshot_whose_content_breaks_an_observer_is_ignored_not_raised():
    """A nested registry value raises RecursionError in the node's document observer while it loads."""
    source = Replica("a")
    source.set_registry("engine-1", {"url": "http://e:8000"})
    snapshot = Snapshot.of(source.doc, 1.0)
    target = Replica("b")
    target.doc.subscribe(lambda changes: json.loads("[" * 100_000))
    stats: Counter[str] = Counter()
    assert not await load_into(FakeStore(snapshot), SyncProtocol(target.doc), stats)
    assert stats["snapshot_rejected_unusable"] == 1


def test_seed_entries_are_sealed_and_bad_ones_have_a_reason():
    key, now = b"kvmesh:seeds:c1:a", 1000.0
    value = seal_entry(SECRET, key, "127.0.0.1:7946", now)
    assert open_entry(SECRET, key, value, now, 60) == "127.0.0.1:7946"
    cases = {
        b"\xff\xfe": "encoding",
        b"127.0.0.1:7946": "unsealed",
        value.replace(b"7946", b"7947"): "mac",
        seal_entry(SECRET, b"kvmesh:seeds:c1:b", "127.0.0.1:7946", now): "mac",
        seal_entry(SECRET, key, "127.0.0.1:7946", now - 61): "stale",
        seal_entry(SECRET, key, "no-port", now): "malformed",
        b"x" * 1000: "oversize",
    }
    for bad, why in cases.items():
        with pytest.raises(SeedRejected, match=why):
            open_entry(SECRET, key, bad, now, 60)
    assert open_entry(None, key, b"127.0.0.1:7946", now, 60) == "127.0.0.1:7946"


async def test_a_seed_round_that_raises_anything_is_counted_and_retried():
    class Registry:
        ttl = 0.03
        rounds = 0

        def publish(self, addr: str) -> None:
            pass

        def discover(self) -> list[str]:
            self.rounds += 1
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        def withdraw(self) -> None:
            pass

        def close(self) -> None:
            pass

    registry, stats = Registry(), Counter()
    with trio.move_on_after(0.2):
        await run_seed_registry(registry, "127.0.0.1:1", lambda seeds: None, stats)
    assert registry.rounds >= 3 and stats["seed_round_failures"] == registry.rounds


@pytest.mark.integration
def test_sealed_registry_skips_foreign_and_non_utf8_entries_in_a_real_redis(redis_server):
    url, _ = redis_server
    a = RedisSeedRegistry(url, "c1", "a", ttl=30, secret=SECRET)
    legacy = RedisSeedRegistry(url, "c1", "legacy", ttl=30)
    a.publish("127.0.0.1:1")
    legacy.publish("127.0.0.1:2")
    client = redis.Redis.from_url(url)
    client.set("kvmesh:seeds:c1:poison", b"\xff\xfe\xfd")
    assert a.discover() == ["127.0.0.1:1"]
    assert a.rejected == {"unsealed": 1, "encoding": 1}
    assert legacy.discover() == ["127.0.0.1:2"]  # without the secret: only parseable addresses, never a raise
    client.close()
    for r in (a, legacy):
        r.close()


@pytest.mark.integration
async def test_sealed_snapshots_round_trip_through_a_real_redis_and_forgeries_start_cold(redis_server):
    url, _ = redis_server
    store = RedisSnapshotStore(url, "c1", secret=SECRET)
    source = Replica("a")
    source.store("engine-1", [(1, 7), (2, 9)])
    store.save(Snapshot.of(source.doc, time.time()))
    fresh = Replica("b")
    assert await load_into(store, SyncProtocol(fresh.doc), Counter())
    assert fresh.pairs("engine-1") == source.pairs("engine-1")
    client = redis.Redis.from_url(url)
    client.hset(store.key, "epoch_number", str(2**64))
    client.close()
    stats: Counter[str] = Counter()
    assert not await load_into(store, SyncProtocol(Replica("c").doc), stats)
    assert stats["snapshot_rejected_mac"] == 1
    store.close()
