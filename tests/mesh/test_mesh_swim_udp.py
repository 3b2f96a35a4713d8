"""Several Memberships in one trio run over real loopback UDP: join, partition and heal, leave."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

import trio

from mesh.gossip import Membership
from mesh.settings import MeshSettings
from mesh.swim import State

SECRET = b"test-secret-for-the-mesh-0123456789"


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


@asynccontextmanager
async def mesh(n: int, secret: bytes = SECRET):
    async with trio.open_nursery() as nursery:
        first = await nursery.start(Membership(MeshSettings(secret=SECRET, name="m0", bind="127.0.0.1:0")).run)
        seed = (first.self_member.gossip_addr,)
        members = [first]
        for i in range(1, n):
            config = MeshSettings(secret=secret, name=f"m{i}", bind="127.0.0.1:0", seeds=seed, island=f"i{i}")
            members.append(await nursery.start(Membership(config).run))
        yield members
        nursery.cancel_scope.cancel()


def ids(members: list[Membership]) -> set[str]:
    return {m.member_id for m in members}


def view(m: Membership) -> set[str]:
    return {x.id for x in m.live_members()}


async def test_members_join_through_one_seed_and_carry_metadata():
    async with mesh(4) as members:
        await wait_for(lambda: all(view(m) == ids(members) for m in members))
        peer = next(x for x in members[0].live_members() if x.id == members[3].member_id)
        assert peer.island == "i3" and peer.gossip_addr == members[3].self_member.gossip_addr


async def test_cut_off_member_is_declared_dead_then_rejoins_after_heal():
    async with mesh(4) as members:
        await wait_for(lambda: all(view(m) == ids(members) for m in members))
        lonely, rest = members[3], members[:3]
        events = rest[0].subscribe()
        lonely.block_peers(ids(rest))
        await wait_for(lambda: all(m.members()[lonely.member_id].state == State.DEAD for m in rest))
        assert all(view(m) == ids(rest) for m in rest)
        lonely.unblock_all()
        await wait_for(lambda: all(view(m) == ids(members) for m in members))
        assert lonely.incarnation > 0
        kinds = []
        while True:
            try:
                ev = events.receive_nowait()
            except trio.WouldBlock:
                break
            if ev.member.id == lonely.member_id:
                kinds.append(ev.kind)
        assert kinds[-1] == "alive" and "dead" in kinds


async def test_leave_removes_member_everywhere_at_once():
    async with mesh(3) as members:
        await wait_for(lambda: all(view(m) == ids(members) for m in members))
        leaver = members[2]
        with trio.fail_after(5):
            await leaver.leave()
        await wait_for(
            lambda: all(m.members()[leaver.member_id].state == State.LEFT for m in members[:2]), 1.0
        )


async def test_wrong_secret_member_is_never_admitted_and_its_packets_are_counted():
    async with mesh(2) as members, trio.open_nursery() as nursery:
        await wait_for(lambda: all(view(m) == ids(members) for m in members))
        seeds = tuple(m.self_member.gossip_addr for m in members)
        config = MeshSettings(
            secret=b"a-different-secret-0123456789", name="intruder", bind="127.0.0.1:0", seeds=seeds
        )
        intruder = await nursery.start(Membership(config).run)
        await wait_for(lambda: sum(m.stats["auth_failures"] for m in members) >= 4)
        assert all(view(m) == ids(members) for m in members)
        assert all(intruder.member_id not in m.members() for m in members)
        assert view(intruder) == {intruder.member_id}
        nursery.cancel_scope.cancel()
