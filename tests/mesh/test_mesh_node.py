"""MeshNode: several nodes in one trio process over real loopback UDP (gossip) and TCP (replication)."""

from __future__ import annotations

import contextlib
import json

import pytest
import trio
from mesh.ownership import owners
from mesh_node_helpers import settings, start_mesh, start_node, wait_until

from mesh.node import MeshNode

ENGINES = [f"engine-{i}" for i in range(24)]


def test_settings_are_validated_before_anything_starts():
    for bad in (
        {"redundancy": 0},
        {"reconcile_interval": 0},
        {"bind": "nowhere"},
        {"replication_bind": "127.0.0.1"},
        {"seeds": ("x",)},
        {"replication_bind": "0.0.0.0:0"},
        {"bind": "0.0.0.0:0"},
    ):
        with pytest.raises(ValueError):
            MeshNode(settings("bad", **bad))


@pytest.mark.mesh
async def test_nodes_join_through_seeds_and_agree_on_ownership():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 4)
        ids = [r.node.member_id for r in nodes]
        channels = [r.node.watch_ownership(lambda: ENGINES) for r in nodes]
        for engine in ENGINES:
            views = {tuple(r.node.owners(engine)) for r in nodes}
            assert views == {tuple(owners(engine, ids, 2))}
            (owner_list,) = views
            assert len(owner_list) == 2
            assert [r.node.is_owner(engine) for r in nodes].count(True) == 2
        owned = [ch.receive_nowait() for ch in channels]
        for r, engine_set in zip(nodes, owned, strict=True):
            assert engine_set == {e for e in ENGINES if r.node.member_id in owners(e, ids, 2)}
        assert sum(len(s) for s in owned) == 2 * len(ENGINES)
        description = nodes[0].node.describe()
        json.dumps(description)
        assert sorted(m["id"] for m in description["members"]) == sorted(ids)
        assert all(m["replication_addr"] for m in description["members"])
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_crashed_owner_is_replaced_by_the_next_in_rendezvous_order_within_3s():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 4)
        ids = [r.node.member_id for r in nodes]
        victim, survivors = nodes[1], [nodes[0], *nodes[2:]]
        victim_engines = [e for e in ENGINES if victim.node.member_id in owners(e, ids, 2)]
        assert victim_engines
        channels = {r.node.member_id: r.node.watch_ownership(lambda: ENGINES) for r in survivors}
        latest = {member: ch.receive_nowait() for member, ch in channels.items()}
        expected = {
            e: [m for m in owners(e, ids, len(ids)) if m != victim.node.member_id][:2] for e in ENGINES
        }

        def taken_over() -> bool:
            for member, ch in channels.items():
                with contextlib.suppress(trio.WouldBlock):
                    latest[member] = ch.receive_nowait()
            return all(
                r.node.owners(e) == expected[e] for r in survivors for e in ENGINES
            ) and all(latest[m] == {e for e in ENGINES if m in expected[e]} for m in latest)

        crashed_at = trio.current_time()
        victim.crash()
        await wait_until(taken_over, 10)
        took = trio.current_time() - crashed_at
        print(f"ownership moved on all survivors after {took:.2f}s")
        assert took <= 3.0
        for engine in victim_engines:
            assert all(r.node.owner_present(engine) for r in survivors)
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_engine_without_a_live_owner_is_observable_until_a_new_owner_takes_over():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3, redundancy=1)
        ids = [r.node.member_id for r in nodes]
        victim = next(r for r in nodes if r.node.member_id == owners("engine-x", ids, 1)[0])
        survivors = [r for r in nodes if r is not victim]
        flips: dict[str, list[bool]] = {r.node.member_id: [] for r in survivors}
        for r in survivors:
            r.node.on_owner_presence(lambda engine, present, m=r.node.member_id: flips[m].append(present))
            r.node.watch_ownership(lambda: ["engine-x"])
        victim.crash()
        await wait_until(lambda: all(f[-1:] == [True] for f in flips.values()), 10)
        assert all(f == [False, True] for f in flips.values()), flips
        assert sum(r.node.is_owner("engine-x") for r in survivors) == 1
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_registry_change_on_one_node_is_visible_and_signalled_on_all():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        seen: dict[str, list] = {r.node.member_id: [] for r in nodes}
        for r in nodes:
            r.node.on_registry(lambda engine, state, m=r.node.member_id: seen[m].append((engine, state)))
        nodes[0].node.set_engine_state("engine-1", {"drain": True, "island": "east"})
        await wait_until(lambda: all(r.node.engine_states() == {"engine-1": {"drain": True, "island": "east"}}
                                     for r in nodes))
        nodes[2].node.set_engine_state("engine-1", None)
        await wait_until(lambda: all(r.node.engine_states() == {} for r in nodes))
        for events in seen.values():
            assert events == [("engine-1", {"drain": True, "island": "east"}), ("engine-1", None)]
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_seq_advances_reach_non_owners_and_give_a_new_owner_its_resume_point():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3, redundancy=1)
        engine = "engine-7"
        owner = next(r for r in nodes if r.node.is_owner(engine))
        others = [r for r in nodes if r is not owner]
        seqs: dict[str, list] = {r.node.member_id: [] for r in others}
        for r in others:
            r.node.on_seq(lambda e, seq, m=r.node.member_id: seqs[m].append((e, seq)))
        owner.node.store.store(engine, [(h, h + 1) for h in range(32)])
        owner.node.store.set_seq(engine, 41)
        owner.node.store.set_seq(engine, 42)
        await wait_until(lambda: all(s[-1:] == [(engine, 42)] for s in seqs.values()))
        for r in others:
            assert r.node.resume_seq(engine) == 42
            assert r.node.store.block_count(engine) == 32
            assert engine in r.node.known_engines()
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_a_raising_callback_is_counted_and_replication_goes_on():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 2)

        def broken(_engine: str, _seq: int) -> None:
            raise RuntimeError("router bug")

        nodes[1].node.on_seq(broken)
        nodes[0].node.store.set_seq("engine-1", 1)
        nodes[0].node.store.set_seq("engine-2", 2)
        await wait_until(lambda: nodes[1].node.resume_seq("engine-2") == 2)
        assert nodes[1].node.stats["callback_errors"] >= 1
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_isolated_node_is_cut_off_both_ways_and_converges_after_heal():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        lonely, majority = nodes[2], nodes[:2]
        lonely.node.isolate(True)
        await wait_until(lambda: lonely.node.live_members() == [lonely.node.member_id])
        await wait_until(lambda: all(lonely.node.member_id not in r.node.live_members() for r in majority))
        majority[0].node.store.store("engine-a", [(1, 10), (2, 20)])
        lonely.node.store.store("engine-b", [(3, 30)])
        await wait_until(lambda: majority[1].node.store.block_count("engine-a") == 2)
        await trio.sleep(0.5)
        assert lonely.node.store.block_count("engine-a") == 0
        assert all(r.node.store.block_count("engine-b") == 0 for r in majority)
        assert all(lonely.node.is_owner(e) for e in ENGINES)
        lonely.node.isolate(False)
        everyone = sorted(r.node.member_id for r in nodes)
        await wait_until(lambda: all(r.node.live_members() == everyone for r in nodes), 15)
        await wait_until(
            lambda: all(r.node.store.doc.content == nodes[0].node.store.doc.content for r in nodes), 10
        )
        assert nodes[0].node.store.block_count("engine-b") == 1
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_node_with_the_wrong_secret_is_refused():
    async with trio.open_nursery() as nursery:
        (good,) = await start_mesh(nursery, 1)
        good.node.store.set_seq("engine-1", 5)
        intruder = await start_node(
            nursery, settings("intruder", (good.gossip_addr,), secret=b"another-secret-0123456789")
        )
        await wait_until(lambda: good.node.describe()["gossip"].get("auth_failures", 0) >= 3)
        assert good.node.live_members() == [good.node.member_id]
        assert intruder.node.live_members() == [intruder.node.member_id]
        assert intruder.node.resume_seq("engine-1") is None
        nursery.cancel_scope.cancel()


@pytest.mark.mesh
async def test_graceful_leave_moves_ownership_at_once_and_ends_watch_channels():
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3)
        leaver = nodes[0]
        channel = leaver.node.watch_ownership(lambda: ENGINES)
        await leaver.node.leave()
        remaining = sorted(r.node.member_id for r in nodes[1:])
        await wait_until(lambda: all(r.node.live_members() == remaining for r in nodes[1:]), 2.0)
        with trio.fail_after(2):
            async for _ in channel:
                pass
        nursery.cancel_scope.cancel()

