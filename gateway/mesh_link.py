"""The router's side of the mesh: build the node from config, and keep local state in step with it.

What flows from the mesh into this replica: admin state of engines (drain, maintenance, island, added
and removed engines), the blocks other replicas just sent to engines (speculative entries; for engines
without events, the approximate index itself), and how many requests the other replicas have in flight
per engine (fresher than any engine's /metrics). The block index does not flow here: every replica
ingests every engine's events itself (gateway/event_ingest.py).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from gateway.admin import ADMIN_STATE_KEYS, check_engine_setting
from gateway.config import ConfigError, EngineConfig, RouterConfig, validate_engine_url
from gateway.engines import EngineState
from gateway.mesh_state import NAMESPACES, MeshState
from mesh.auth import load_secret
from mesh.node import MeshNode
from mesh.settings import MeshSettings

DISPATCH_SWEEP_S = 5.0
DISPATCH_FLUSH_S = 0.25
"""A bucket is rewritten whole, so writes are batched: a write per request re-sent the growing bucket."""
log = logging.getLogger("kvmesh.mesh")

if TYPE_CHECKING:
    from gateway.router import Router


def build_mesh_node(config: RouterConfig) -> MeshNode | None:
    mesh = config.mesh
    if mesh.bind is None:
        return None
    if mesh.secret_file is None:
        raise ConfigError("mesh.secret_file: required when mesh.bind is set (every mesh packet is authenticated)")
    try:
        secret = load_secret(mesh.secret_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"mesh.secret_file: {exc}") from None
    replication = mesh.replication_bind or f"{mesh.bind.rsplit(':', 1)[0]}:0"
    settings = MeshSettings(
        secret=secret, name=f"{socket.gethostname()}-{config.port}", bind=mesh.bind,
        advertise=mesh.advertise or _advertise_for(mesh.bind), seeds=tuple(mesh.seeds),
        replication_bind=replication, http_addr=f"http://{config.host}:{config.port}", island=config.island or "",
        cluster=mesh.cluster, redis_url=mesh.redis_url,
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise ConfigError(f"mesh: {exc}") from None
    return MeshNode(settings, NAMESPACES)


def _advertise_for(bind: str) -> str | None:
    """A wildcard bind (containers) advertises this host's own address, so peers can reach it."""
    host, _, port = bind.rpartition(":")
    if host not in ("0.0.0.0", "::", "[::]"):
        return None
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return None


def registry_state(engine: EngineState) -> dict[str, Any]:
    return {"draining": engine.draining, "maintenance": engine.maintenance, "island": engine.config.island,
            "zone": engine.zone}


async def sweep_dispatches(state: MeshState) -> None:
    """Every replica writes its dispatch buckets that changed; the mesh's leader also deletes expired ones
    (a departed replica's too), so the document does not keep them."""
    swept_at = 0.0
    while True:
        await trio.sleep(DISPATCH_FLUSH_S)
        now = time.time()
        state.flush_dispatches(now)
        if now - swept_at >= DISPATCH_SWEEP_S and state.node.is_leader():
            state.sweep_dispatches(now)
            swept_at = now


def registry_settings(state: dict[str, Any]) -> dict[str, Any]:
    """The admin settings of a replicated registry entry, type-checked; ValueError names the bad one."""
    settings = {key: state[key] for key in ADMIN_STATE_KEYS if key in state}
    for key, value in settings.items():
        check_engine_setting(key, value)
    return settings


def follow_mesh(router: Router, state: MeshState) -> None:
    """Subscribe the router to the mesh's change feeds; each callback is cheap and never awaits."""
    node = state.node

    def on_registry(engine_id: str, entry: dict[str, Any] | None) -> None:
        """A peer's registry entry is untrusted like any input: a bad URL or value is counted and logged,
        never added (prompts would flow to it) and never raised into replication."""
        if entry is None or entry.get("removed") is True:
            if router.engines.get(engine_id) is not None:
                router.remove_engine(engine_id, replicate=False)
            return
        try:
            settings = registry_settings(entry)
            if router.engines.get(engine_id) is None and "url" in entry:
                router.add_engine(EngineConfig(url=validate_engine_url(entry["url"]), id=engine_id,
                                               island=settings.get("island")), replicate=False)
        except (ValueError, TypeError) as exc:
            state.malformed["registry"] += 1
            log.warning("refused a replicated engine entry", extra={"engine": engine_id[:200], "reason": str(exc)})
            return
        router.set_engine_state(engine_id, settings, replicate=False)

    def on_dispatch(engine_id: str, own_keys: list[int], expires_at: float) -> None:
        router.planner.cache.record_remote_dispatch(engine_id, own_keys, trio.current_time(),
                                                    expires_at - time.time())

    def share_dispatch(engine_id: str, own_keys: Sequence[int], ttl_s: float) -> None:
        state.publish_dispatch(engine_id, own_keys, time.time(), ttl_s)

    state.on_registry(on_registry)
    state.on_dispatch(on_dispatch)
    router.planner.share_dispatch = share_dispatch
    node.share_load(lambda: {e.id: e.in_flight for e in router.engines.all() if e.in_flight > 0})
    router.planner.peer_in_flight = node.peer_in_flight
    for engine_id, engine_state in state.registry().items():
        on_registry(engine_id, engine_state)
