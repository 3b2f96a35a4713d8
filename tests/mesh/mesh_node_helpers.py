"""Shared helpers for the MeshNode tests: nodes in one trio process over real loopback UDP and TCP."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import trio

from gateway.mesh_state import NAMESPACES, MeshState
from mesh.node import MeshNode
from mesh.settings import MeshSettings

SECRET = b"node-test-secret-0123456789"


def settings(name: str, seeds: tuple[str, ...] = (), **overrides: object) -> MeshSettings:
    values: dict = {
        "secret": SECRET,
        "name": name,
        "bind": "127.0.0.1:0",
        "seeds": seeds,
        "anti_entropy_interval": 0.3,
    }
    values.update(overrides)
    return MeshSettings(**values)


@dataclass
class Running:
    """A node with its own cancel scope, so a test can stop one node without stopping the others."""

    node: MeshNode
    scope: trio.CancelScope
    state: MeshState

    @property
    def gossip_addr(self) -> str:
        return self.node.describe()["members"][0]["gossip_addr"]

    def crash(self) -> None:
        """Stop without a graceful leave: cut every packet first, so not even the leave gets out."""
        self.node.isolate(True)
        self.scope.cancel()


async def _host(node: MeshNode, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            task_status.started(scope)


async def start_node(nursery: trio.Nursery, node_settings: MeshSettings) -> Running:
    node = MeshNode(node_settings, NAMESPACES)
    state = MeshState(node)
    scope = await nursery.start(_host, node)
    return Running(node, scope, state)


async def start_mesh(nursery: trio.Nursery, n: int, **overrides: object) -> list[Running]:
    """``n`` nodes seeded from the first; returns once every node sees all of them live."""
    first = await start_node(nursery, settings("n0", **overrides))
    nodes = [first]
    for i in range(1, n):
        nodes.append(await start_node(nursery, settings(f"n{i}", (first.gossip_addr,), **overrides)))
    everyone = sorted(r.node.member_id for r in nodes)
    await wait_until(lambda: all(r.node.live_members() == everyone for r in nodes), 15)
    return nodes


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def free_port() -> int:
    """A TCP port nothing listens on right now (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
