"""The router's side of the mesh: build the node from config, and keep local state in step with it.

What flows from the mesh into this replica: admin state of engines (drain, maintenance, island, added
and removed engines), the blocks other replicas just sent to engines (speculative entries; for engines
without events, the approximate index itself), the requests they placed (each prefix's homes and heat,
recorded as if this replica had placed them), and how many requests the other replicas have in flight
per engine (fresher than any engine's /metrics). The block index does not flow here: every replica
ingests every engine's events itself (gateway/event_ingest.py).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import trio

from autoscale.supervise import TaskFaults, supervise
from gateway.config import ConfigError, EngineConfig, RouterConfig, _build
from gateway.fleet import ENGINE_FIELDS, Fleet, registry_settings
from gateway.mesh_state import NAMESPACES, MeshState, Placement
from gateway.openai_errors import ApiError
from gateway.routing.kv_aware import KvAwarePolicy
from mesh.auth import load_secret
from mesh.node import MeshNode
from mesh.settings import MeshSettings

DISPATCH_SWEEP_S = 5.0
DISPATCH_FLUSH_S = 0.25
"""A bucket is rewritten whole, so writes are batched: a write per request re-sent the growing bucket."""
PLACEMENT_FLUSH_S = 0.02
"""How long after the first placement since the last write the next is written: a new prefix's first requests
reach every replica within milliseconds, and a quarter second (the dispatch buckets' interval, which placements
used to share) let each replica home a prefix elsewhere before it heard of the others' choice."""
TOMBSTONE_SWEEP_S = 60.0
TOMBSTONE_TTL_S = 3600.0
"""A removed engine's tombstone is kept this long: a replica cut off for less learns of the removal from it
(one cut off for longer still holds the live entry, which a merge re-adds as a registry value)."""
log = logging.getLogger("kvmesh.mesh")


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


def mesh_report(mesh: MeshNode | None, ingesting: list[str], index_transfer: dict[str, int]) -> dict[str, Any]:
    """``GET /admin/mesh``: members, their state, and which engines this replica ingests."""
    if mesh is None:
        return {"enabled": False, "members": []}
    return {"enabled": True, **mesh.describe(), "ingesting": ingesting, "index_transfer": index_transfer}


def isolate(mesh: MeshNode | None, isolated: bool) -> None:
    """Cut this replica off the mesh (or rejoin it): for chaos tests and operators."""
    if mesh is None:
        raise ApiError(409, "this router runs without a mesh", code="no_mesh")
    mesh.isolate(isolated)


async def leave_mesh(mesh: MeshNode | None) -> None:
    """Tell the peers this replica is going, within 2 s."""
    if mesh is not None:
        with trio.move_on_after(2):
            await mesh.leave()


def _advertise_for(bind: str) -> str | None:
    """A wildcard bind (containers) advertises this host's own address, so peers can reach it."""
    host, _, port = bind.rpartition(":")
    if host not in ("0.0.0.0", "::", "[::]"):
        return None
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return None


def replicated_engine(engine_id: str, entry: dict[str, Any], island: str | None) -> EngineConfig:
    """The EngineConfig of a peer's registry entry, checked like a configured engine; ConfigError if not."""
    table = {key: entry[key] for key in ENGINE_FIELDS if entry.get(key) is not None}
    config = _build(EngineConfig, {**table, "id": engine_id, "island": island}, "replicated engine")
    config.validate("replicated engine")
    return config


def _nothing() -> None:
    """No one to tell that a step succeeded."""


async def sweep_dispatches(state: MeshState, stepped: Callable[[], None] = _nothing) -> None:
    """Every replica writes its dispatch buckets that changed; the mesh's leader also deletes expired buckets (a
    departed replica's too) and departed replicas' placements, so the document does not keep them."""
    swept_at = 0.0
    while True:
        await trio.sleep(DISPATCH_FLUSH_S)
        now = time.time()
        state.flush_dispatches(now)
        if now - swept_at >= DISPATCH_SWEEP_S and state.node.is_leader():
            state.sweep_dispatches(now)
            state.sweep_placements(state.live_members())
            swept_at = now
        stepped()


async def share_placements(state: MeshState, stepped: Callable[[], None] = _nothing) -> None:
    """Write this replica's placements ``PLACEMENT_FLUSH_S`` after the first one since the last write; asleep while
    it places nothing."""
    due = trio.Event()
    state.on_placement_due = due.set
    try:
        while True:
            await due.wait()
            due = trio.Event()
            state.on_placement_due = due.set
            await trio.sleep(PLACEMENT_FLUSH_S)
            state.flush_placements()
            stepped()
    finally:
        state.on_placement_due = None


async def sweep_tombstones(state: MeshState, stepped: Callable[[], None] = _nothing) -> None:
    """The mesh's leader deletes registry entries of engines removed more than TOMBSTONE_TTL_S ago, so
    autoscaler churn does not grow the document (and every snapshot) by one entry per engine ever run."""
    while True:
        await trio.sleep(TOMBSTONE_SWEEP_S)
        if state.node.is_leader():
            state.sweep_tombstones(time.time() - TOMBSTONE_TTL_S)
        stepped()


MESH_TASKS = {"dispatch sweep": sweep_dispatches, "placement sharing": share_placements,
              "tombstone sweep": sweep_tombstones}


async def run_mesh_tasks(state: MeshState) -> None:
    """The replica's tasks that write its state into the mesh, each under one owner: a failure is logged once per
    episode, counted (``kvmesh_mesh_task_failures_total``) and the task started again after a backoff."""
    faults = TaskFaults(lambda task, reason: state.task_failures.update([(task, reason)]), log, "mesh")
    async with trio.open_nursery() as nursery:
        for name, loop in MESH_TASKS.items():
            nursery.start_soon(supervise, faults, name, partial(loop, state, partial(faults.succeeded, name)))


def follow_mesh(fleet: Fleet, state: MeshState) -> None:
    """Keep the fleet in step with the mesh's change feeds, and publish its changes there; each callback is
    cheap and never awaits."""
    node = state.node
    planner = fleet.planner

    def on_registry(engine_id: str, entry: dict[str, Any] | None) -> None:
        """A peer's registry entry is untrusted like any input: a bad URL or value is counted and logged,
        never added (prompts would flow to it) and never raised into replication."""
        if entry is None or entry.get("removed") is True:
            if fleet.engines.get(engine_id) is not None:
                fleet.remove(engine_id, replicate=False)
            return
        try:
            settings = registry_settings(entry)
            if fleet.engines.get(engine_id) is None and "url" in entry:
                fleet.add(replicated_engine(engine_id, entry, settings.get("island")), replicate=False)
        except (ValueError, TypeError) as exc:
            state.malformed["registry"] += 1
            log.warning("refused a replicated engine entry", extra={"engine": engine_id[:200], "reason": str(exc)})
            return
        fleet.set_state(engine_id, settings, replicate=False)

    def on_dispatch(engine_id: str, own_keys: list[int], expires_at: float) -> None:
        planner.cache.record_remote_dispatch(engine_id, own_keys, trio.current_time(),
                                                    expires_at - time.time())

    def share_dispatch(engine_id: str, own_keys: Sequence[int], ttl_s: float) -> None:
        state.publish_dispatch(engine_id, own_keys, time.time(), ttl_s)

    def on_placements(replica: str, placements: list[Placement]) -> None:
        """A peer's placements heat this replica's home book; those naming an engine it does not know (an
        untrusted peer's, or one added a moment ago) are counted and skipped."""
        for key, engine_id, blocks, capacity, session, shared in placements:
            if fleet.engines.get(engine_id) is None:
                state.malformed["placement_engine"] += 1
                continue
            policy.record_peer_placement(key, engine_id, blocks, capacity, session, shared)

    policy = planner.policy
    if isinstance(policy, KvAwarePolicy) and policy.keeps_homes:
        policy.on_placed = state.publish_placement
        policy.agree_with_peers = True
        state.on_placements(on_placements)
    fleet.replicate = state.set_registry
    state.on_registry(on_registry)
    state.on_dispatch(on_dispatch)
    planner.share_dispatch = share_dispatch
    node.share_load(lambda: {e.id: e.in_flight for e in fleet.engines.all() if e.in_flight > 0})
    planner.peer_in_flight = node.peer_in_flight
    for engine_id, engine_state in state.registry().items():
        on_registry(engine_id, engine_state)
