"""MeshNode: several nodes in one trio process over real loopback UDP (gossip) and TCP (replication)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from mesh_node_helpers import settings, start_mesh, start_node, wait_until

from gateway import index_transfer
from gateway.mesh_state import NAMESPACES
from mesh.node import MeshNode


def test_settings_are_validated_before_anything_starts():
    for bad in (
        {"anti_entropy_interval": 0},
        {"bind": "nowhere"},
        {"replication_bind": "127.0.0.1"},
        {"seeds": ("x",)},
        {"replication_bind": "0.0.0.0:0"},
        {"bind": "0.0.0.0:0"},
    ):
        with pytest.raises(ValueError):
            MeshNode(settings("bad", **bad), NAMESPACES)


@pytest.mark.mesh
async def test_nodes_join_through_seeds_and_exactly_one_leads():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        assert [r.node.is_leader() for r in nodes].count(True) == 1
        views = [r.node.watch_view() for r in nodes]
        everyone = sorted(r.node.member_id for r in nodes)
        for channel in views:
            with trio.fail_after(2):
                assert await channel.receive() == everyone
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_registry_change_on_one_node_is_visible_and_signalled_on_all():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        seen: dict[str, list] = {r.node.member_id: [] for r in nodes}
        for r in nodes:
            r.state.on_registry(lambda engine, state, m=r.node.member_id: seen[m].append((engine, state)))
        nodes[0].state.set_registry("engine-1", {"drain": True, "island": "east"})
        await wait_until(lambda: all(r.state.registry() == {"engine-1": {"drain": True, "island": "east"}}
                                     for r in nodes))
        nodes[2].state.set_registry("engine-1", None)
        await wait_until(lambda: all(r.state.registry() == {} for r in nodes))
        for events in seen.values():
            assert events == [("engine-1", {"drain": True, "island": "east"}), ("engine-1", None)]
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_a_raising_callback_is_counted_and_replication_goes_on():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 2)

        def broken(_engine: str, _state: object) -> None:
            raise RuntimeError("router bug")

        nodes[1].state.on_registry(broken)
        nodes[0].state.set_registry("engine-1", {"island": "a"})
        nodes[0].state.set_registry("engine-2", {"island": "b"})
        await wait_until(lambda: "engine-2" in nodes[1].state.registry())
        assert nodes[1].state.malformed["callback_errors"] >= 1
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_hostile_registry_values_are_counted_not_raised():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 2)
        nodes[0].node.write([("registry", "deep", "[" * 100_000 + "]" * 100_000),
                             ("registry", "scalar", "5"), ("registry", "huge", '"' + "x" * 100_000 + '"')])
        nodes[0].state.set_registry("engine-ok", {"island": "a"})
        await wait_until(lambda: "engine-ok" in nodes[1].state.registry())
        assert nodes[1].state.malformed["registry"] >= 3
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_isolated_node_is_cut_off_both_ways_and_converges_after_heal():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        lonely, majority = nodes[2], nodes[:2]
        lonely.node.isolate(True)
        await wait_until(lambda: lonely.node.live_members() == [lonely.node.member_id])
        await wait_until(lambda: all(lonely.node.member_id not in r.node.live_members() for r in majority))
        majority[0].state.set_registry("engine-a", {"island": "a"})
        lonely.state.set_registry("engine-b", {"island": "b"})
        await wait_until(lambda: "engine-a" in majority[1].state.registry())
        await trio.sleep(0.5)
        assert "engine-a" not in lonely.state.registry()
        assert all("engine-b" not in r.state.registry() for r in majority)
        assert await lonely.node.fetch_state(index_transfer.NAMESPACE, "engine-a", 0.5) == {}
        lonely.node.isolate(False)
        everyone = sorted(r.node.member_id for r in nodes)
        await wait_until(lambda: all(r.node.live_members() == everyone for r in nodes), 15)
        await wait_until(lambda: all(r.node.doc.content == nodes[0].node.doc.content for r in nodes), 10)
        assert "engine-b" in nodes[0].state.registry()
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_node_with_the_wrong_secret_is_refused():
    async with trio.open_nursery() as nursery:
        (good,) = await start_mesh(nursery, 1)
        good.state.set_registry("engine-1", {"island": "a"})
        intruder = await start_node(
            nursery, settings("intruder", (good.gossip_addr,), secret=b"another-secret-0123456789")
        )
        await wait_until(lambda: good.node.describe()["gossip"].get("auth_failures", 0) >= 3)
        assert good.node.live_members() == [good.node.member_id]
        assert intruder.node.live_members() == [intruder.node.member_id]
        assert intruder.state.registry() == {}
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_state_transfer_of_two_million_blocks_arrives_whole_in_chunks():
    """A 32 MB index answer crosses real TCP in 1 MiB chunks, far under the 16 MiB frame limit, and a peer
    that holds nothing says so instead of being waited for."""
    hashes = np.arange(2_000_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) % np.uint64(2**60)
    own_keys = hashes ^ np.uint64(0x5A5A)
    none = np.zeros(0, dtype=np.uint64)
    blob = index_transfer.encode([41, None], [hashes, none], [own_keys, none])
    async with trio.open_nursery() as nursery:
        holder, empty, newcomer = await start_mesh(nursery, 3)
        holder.node.serve_state(index_transfer.NAMESPACE, lambda key: blob if key == "engine-1" else None)
        empty.node.serve_state(index_transfer.NAMESPACE, lambda key: None)
        await wait_until(lambda: len(newcomer.node.replication.connected_peers()) == 2)
        answers = await newcomer.node.fetch_state(index_transfer.NAMESPACE, "engine-1", 20.0)
        assert answers == {holder.node.member_id: blob, empty.node.member_id: None}
        assert newcomer.node.replication.counters["dropped_oversized"] == 0
        assert holder.node.protocol.counters["state_chunks_sent"] == -(-len(blob) // (1 << 20))
        snapshot = index_transfer.decode(answers[holder.node.member_id], sources=2)
        assert snapshot.seqs == (41, None) and snapshot.blocks == 2_000_000
        assert np.array_equal(snapshot.own_keys[0], own_keys) and len(snapshot.own_keys[1]) == 0
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_graceful_leave_updates_the_view_at_once_and_ends_watch_channels():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        leaver = nodes[0]
        channel = leaver.node.watch_view()
        await leaver.node.leave()
        remaining = sorted(r.node.member_id for r in nodes[1:])
        await wait_until(lambda: all(r.node.live_members() == remaining for r in nodes[1:]), 2.0)
        with trio.fail_after(2):
            async for _ in channel:
                pass
        nursery.cancel_scope.cancel()
