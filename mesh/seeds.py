"""Where a replica finds its first peers: static seeds from config, optionally a Redis seed registry.

Each replica SETs ``kvmesh:seeds:<cluster>:<member-id>`` to its gossip address with a TTL and keeps
refreshing it; readers SCAN the prefix. Redis is only a rendezvous: when it dies, gossip keeps working
with the peers already known. redis-py's asyncio client does not work under trio, so the sync client
runs in a worker thread with short socket timeouts.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable

import redis
import trio

log = logging.getLogger(__name__)

_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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


class RedisSeedRegistry:
    """Blocking client for the seed registry; call it through :func:`trio.to_thread.run_sync`."""

    def __init__(
        self, url: str, cluster: str, member_id: str, ttl: float = 10.0, socket_timeout: float = 0.5
    ) -> None:
        if not _CLUSTER_NAME.match(cluster):
            raise ValueError(f"cluster name {cluster!r} must match {_CLUSTER_NAME.pattern}")
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, decode_responses=True
        )
        self._prefix = f"kvmesh:seeds:{cluster}:"
        self._key = self._prefix + member_id
        self.ttl = ttl

    def publish(self, gossip_addr: str) -> None:
        self._client.set(self._key, gossip_addr, px=int(self.ttl * 1000))

    def discover(self) -> list[str]:
        """Gossip addresses of every registered replica (entries that are not host:port are skipped)."""
        keys = list(self._client.scan_iter(match=self._prefix + "*", count=200))
        values = self._client.mget(keys) if keys else []
        found = []
        for value in values:
            try:
                parse_hostport(value or "")
            except ValueError:
                continue
            found.append(value)
        return sorted(set(found))

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

    Redis errors are counted in ``stats["redis_errors"]`` and retried next round; on exit the entry is
    withdrawn (best effort) so newcomers do not try a replica that is gone.
    """
    task_status.started()
    try:
        while True:
            try:
                await trio.to_thread.run_sync(registry.publish, gossip_addr)
                on_seeds(await trio.to_thread.run_sync(registry.discover))
                stats["redis_rounds"] += 1
            except (redis.RedisError, OSError) as exc:
                stats["redis_errors"] += 1
                log.debug("seed registry unavailable: %s", exc)
            await trio.sleep(registry.ttl / 3)
    finally:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await trio.to_thread.run_sync(registry.withdraw)
            except (redis.RedisError, OSError):
                stats["redis_errors"] += 1
        registry.close()
