"""Where a replica finds its first peers: static seeds from config, optionally a Redis seed registry.

Each replica SETs ``kvmesh:seeds:<cluster>:<member-id>`` to its gossip address with a TTL and keeps
refreshing it; readers SCAN the prefix. Redis is only a rendezvous: when it dies, gossip keeps working
with the peers already known. redis-py's asyncio client does not work under trio, so the sync client
runs in a worker thread with short socket timeouts.

Redis is not trusted. With the mesh secret, each entry is ``host:port unix-time mac`` (HMAC-SHA256,
domain ``kvmesh-seed-v1``, over the key, address and time), and entries that are unsealed, forged, stale
or not even UTF-8 are skipped and counted (``kvmesh_mesh_seed_entries_rejected_total{reason}``). Nothing
Redis holds can raise out of :func:`run_seed_registry`.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable

import redis
import trio
from prometheus_client import Counter as PromCounter

from mesh.auth import record_mac, record_mac_ok

log = logging.getLogger(__name__)

_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SEAL_DOMAIN = b"kvmesh-seed-v1"
MAX_ENTRY_BYTES = 512
MAX_AGE_TTLS = 3
"""A sealed entry older than this many TTLs is a replay of a replica that is gone (its own refresh would
have overwritten it)."""

SEED_ENTRIES_REJECTED = PromCounter("kvmesh_mesh_seed_entries_rejected_total",
                                    "Seed-registry entries in Redis skipped, by reason", ["reason"])


def parse_hostport(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); raises ValueError on anything else."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_seeds(text: str) -> list[str]:
    """A comma-separated seed list as given to ``--seeds``; every entry is validated."""
    seeds = [s.strip() for s in text.split(",") if s.strip()]
    for seed in seeds:
        parse_hostport(seed)
    return seeds


class SeedRejected(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def seal_entry(secret: bytes, key: bytes, gossip_addr: str, now: float) -> bytes:
    stamp = str(int(now))
    mac = record_mac(secret, SEAL_DOMAIN, [key, gossip_addr.encode(), stamp.encode()])
    return f"{gossip_addr} {stamp} {mac.hex()}".encode()


def open_entry(secret: bytes | None, key: bytes, value: bytes, now: float, max_age: float) -> str:
    """The gossip address an entry names; SeedRejected with a reason if it must be skipped."""
    if len(value) > MAX_ENTRY_BYTES:
        raise SeedRejected("oversize")
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        raise SeedRejected("encoding") from None
    if secret is None:
        addr = text
    else:
        parts = text.split(" ")
        if len(parts) != 3:
            raise SeedRejected("unsealed")
        addr, stamp, mac = parts
        try:
            mac_bytes = bytes.fromhex(mac)
        except ValueError:
            raise SeedRejected("unsealed") from None
        if not record_mac_ok(secret, SEAL_DOMAIN, [key, addr.encode(), stamp.encode()], mac_bytes):
            raise SeedRejected("mac")
        if not stamp.isdigit() or abs(now - int(stamp)) > max_age:
            raise SeedRejected("stale")
    try:
        parse_hostport(addr)
    except ValueError:
        raise SeedRejected("malformed") from None
    return addr


class RedisSeedRegistry:
    """Blocking client for the seed registry; call it through :func:`trio.to_thread.run_sync`.

    With ``secret`` (the mesh secret) entries are sealed and only sealed entries are believed.
    """

    def __init__(
        self, url: str, cluster: str, member_id: str, ttl: float = 10.0, socket_timeout: float = 0.5,
        *, secret: bytes | None = None, clock: Callable[[], float] = time.time,
    ) -> None:
        if not _CLUSTER_NAME.match(cluster):
            raise ValueError(f"cluster name {cluster!r} must match {_CLUSTER_NAME.pattern}")
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self._prefix = f"kvmesh:seeds:{cluster}:"
        self._key = self._prefix + member_id
        self.ttl = ttl
        self._secret = secret
        self._clock = clock
        self.rejected: Counter[str] = Counter()
        if secret is None:
            log.warning("Redis seed entries are not sealed: no mesh secret was given to the seed registry")

    def publish(self, gossip_addr: str) -> None:
        value = gossip_addr.encode() if self._secret is None else seal_entry(
            self._secret, self._key.encode(), gossip_addr, self._clock())
        self._client.set(self._key, value, px=int(self.ttl * 1000))

    def discover(self) -> list[str]:
        """Gossip addresses of every registered replica; entries that fail to verify or parse are skipped,
        counted per reason and logged the first time each reason is seen."""
        keys = list(self._client.scan_iter(match=self._prefix + "*", count=200))
        values = self._client.mget(keys) if keys else []
        now, max_age = self._clock(), max(60.0, MAX_AGE_TTLS * self.ttl)
        found = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue  # expired between SCAN and MGET
            try:
                found.append(open_entry(self._secret, bytes(key), bytes(value), now, max_age))
            except SeedRejected as exc:
                self._reject(exc.reason, key)
        return sorted(set(found))

    def _reject(self, reason: str, key: bytes) -> None:
        if not self.rejected[reason]:
            log.warning("skipping seed-registry entries in Redis (%s), first at %r", reason, key[:100])
        self.rejected[reason] += 1
        SEED_ENTRIES_REJECTED.labels(reason).inc()

    def withdraw(self) -> None:
        self._client.delete(self._key)

    def close(self) -> None:
        self._client.close()


async def run_seed_registry(
    registry: RedisSeedRegistry,
    gossip_addr: str,
    on_seeds: Callable[[list[str]], None],
    stats: Counter[str],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish ourselves and hand discovered seeds to ``on_seeds`` every ttl/3 s, until cancelled.

    Redis errors are counted in ``stats["redis_errors"]`` and retried next round; anything else a round
    raises (Redis is untrusted) is counted in ``stats["seed_round_failures"]``, logged once per episode,
    and retried too. On exit the entry is withdrawn (best effort) so newcomers do not try a replica that
    is gone.
    """
    task_status.started()
    failing = False
    try:
        while True:
            try:
                await trio.to_thread.run_sync(registry.publish, gossip_addr)
                on_seeds(await trio.to_thread.run_sync(registry.discover))
                stats["redis_rounds"] += 1
                failing = False
            except (redis.RedisError, OSError) as exc:
                stats["redis_errors"] += 1
                log.debug("seed registry unavailable: %s", exc)
            except Exception:
                stats["seed_round_failures"] += 1
                if not failing:
                    log.exception("seed registry round failed; retrying")
                failing = True
            await trio.sleep(registry.ttl / 3)
    finally:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await trio.to_thread.run_sync(registry.withdraw)
            except (redis.RedisError, OSError):
                stats["redis_errors"] += 1
        registry.close()
