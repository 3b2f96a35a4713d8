"""``kvmesh bench routing --suite``: every policy on shapes drawn at random (bench/suite_shapes.py), each row
against the offline planner's bound (bench/offline_bound.py) for the shape's trace as its first entry sent it.
Bounding a trace costs about 3 s of CPU (tokenizing every request as the engines did, five replays); the entries
send the same conversations in nearly the same order, so one bound per shape serves them all.

Per shape, every (policy, replicas) entry gets its own fresh simulated fleet and routers, forked from a server
that imported their modules once (bench/zygote.py: importing cost each process about 2 s of CPU). They are all
started at once and
then measured one after the other, once every entry is up and the machine is quiet again (bench/settle.py),
each entry's processes stopped before the next one runs, so the runs of one shape share the machine's state
as closely as the runner's back-to-back rows do.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from bench import peers, zygote
from bench.client import Balancer, HttpClient
from bench.processes import StartFailed
from bench.runner import FleetSpec, Load, MeasureOptions, measure_sent, routers, sim_fleet
from bench.settle import until_quiet
from bench.suite_report import ShapeRun
from bench.suite_shapes import Shape, draw_suite, plan
from bench.workloads import total_requests
from sim.profiles import get_profile

DEFAULT_SHAPES = 20
QUICK_SHAPES = 6
KVMESH_POLICIES = ("kv_aware", "approximate", "round_robin")
BUDGET_S = 4.0
"""Wall seconds one measured run of a shape is sized to."""


@dataclass(frozen=True)
class Entry:
    policy: str
    replicas: int
    kill: bool = False
    """One replica is killed (SIGKILL) halfway through the run; the balancer moves on to the survivors."""
    run: int = 1
    """The policy's n-th entry: a policy listed again in ``--policies`` runs again on a fresh fleet of its own, so
    the report can show how far one policy's rows move between two runs of the same shape (bench/suite_report.py
    ``format_reruns``)."""

    @property
    def label(self) -> str:
        if self.replicas == 1:
            return self.policy if self.run == 1 else f"{self.policy} #{self.run}"
        return f"{self.policy} x{self.replicas}>{self.replicas - 1}" if self.kill else f"{self.policy} x{self.replicas}"


def default_policies() -> list[str]:
    """kvmesh's policies, and smg's cache-aware policy when its binary is found (bench/peers.py)."""
    try:
        peers.smg_binary()
    except StartFailed:
        return list(KVMESH_POLICIES)
    return [*KVMESH_POLICIES, "smg:cache_aware"]


def entries(policies: list[str], mesh_policies: list[str], mesh_replicas: int, mesh_kill: bool = False) -> list[Entry]:
    """One router per policy; ``mesh_replicas`` meshed replicas of each mesh policy; with ``mesh_kill``, as many
    again of which one is killed halfway (``kv_aware x3>2``). A policy listed twice gets a second entry
    (``round_robin #2``)."""
    out = [Entry(p, 1, run=policies[:i].count(p) + 1) for i, p in enumerate(policies)]
    if mesh_replicas > 1:
        out += [Entry(p, mesh_replicas) for p in mesh_policies]
        if mesh_kill:
            out += [Entry(p, mesh_replicas, kill=True) for p in mesh_policies]
    return out


def killer(pids: dict[str, int], label: str) -> Callable[[str], None]:
    """What a balancer calls to kill a router replica (by its pid) partway through a run."""

    def kill(url: str) -> None:
        os.kill(pids[url], signal.SIGKILL)
        print(f"  {label}: killed replica {url}", file=sys.stderr, flush=True)

    return kill


def rotated(todo: list[Entry], shape: Shape) -> list[Entry]:
    """The entries in the order shape ``shape.index`` measures them: each shape starts one entry later. While the
    first entry runs, every other entry's routers and engines are up and idle beside it, and on a busy machine
    that cost the first one tens of ms of TTFT (seed 0, shape 6: kv_aware measured first p50 207 ms, alone
    148 ms); rotating spreads that over the policies instead of always charging the same one."""
    start = (shape.index - 1) % len(todo) if todo else 0
    return todo[start:] + todo[:start]


async def run_shape(shape: Shape, todo: list[Entry], fleet: FleetSpec, options: MeasureOptions, budget_s: float,
                    log_dir: Path) -> ShapeRun:
    """Start every entry's fleet and routers at once, then measure the entries one by one (in ``rotated`` order)."""
    todo = rotated(todo, shape)
    profile = get_profile(fleet.profile)
    sized = plan(shape, profile, budget_s)
    spec = replace(fleet, engines=shape.engines, time_scale=fleet.time_scale * sized.time_scale,
                   num_blocks=shape.num_blocks(fleet.block_size))
    client = HttpClient()
    started: list[tuple[list[str], list[str]] | None] = [None] * len(todo)
    pids: list[dict[str, int]] = [{} for _ in todo]
    ready = [trio.Event() for _ in todo]
    release = [trio.Event() for _ in todo]
    stopped = [trio.Event() for _ in todo]

    async def hold(i: int, entry: Entry) -> None:
        try:
            async with (sim_fleet(client, spec, log_dir) as engines,
                        routers(client, engines, entry.policy, entry.replicas, log_dir, options.tokenizer,
                                pids[i]) as urls):
                started[i] = (engines, urls)
                ready[i].set()
                await release[i].wait()
        finally:
            stopped[i].set()

    rows = []
    try:
        async with trio.open_nursery() as nursery:
            for i, entry in enumerate(todo):
                nursery.start_soon(hold, i, entry)
            for event in ready:
                await event.wait()
            for i, entry in enumerate(todo):
                waited, busy = await until_quiet()
                t0 = trio.current_time()
                engines, urls = started[i]  # type: ignore[misc]
                convs = plan(shape, profile, budget_s).conversations  # fresh: a run records answers in them
                load = Load(shape.concurrency, sized.arrival_rate, shape.seed)
                balancer = Balancer(urls, total_requests(convs) // 2, killer(pids[i], entry.label)) \
                    if entry.kill else None
                row = await measure_sent(client, entry.label, urls, engines, load, convs, options, spec,
                                         bounded=not rows, balancer=balancer,
                                         request_log=log_dir / f"requests-{shape.index}-{entry.label}.jsonl",
                                         router_pids=list(pids[i].values()))
                if rows:
                    row.bound_hit_rate, row.bound_ttft_p50 = rows[0].bound_hit_rate, rows[0].bound_ttft_p50
                row.workload = f"#{shape.index}"
                rows.append(row)
                release[i].set()
                await stopped[i].wait()
                took = trio.current_time() - t0
                print(f"  {shape.label} {entry.label}: {row.summary.requests} requests, {row.summary.errors} errors, "
                      f"hit {row.hit_rate:.3f} of bound {row.bound_hit_rate:.3f} (run {row.summary.wall:.1f} s of "
                      f"{took:.0f} s; started after {waited:.1f} s at {busy:.2f} cores busy)", file=sys.stderr,
                      flush=True)
    finally:
        await client.aclose()
    return ShapeRun(shape, sized.time_scale, spec.num_blocks, rows)


def chosen_shapes(seed: int, count: int, only: frozenset[int] = frozenset()) -> list[Shape]:
    """The suite's ``count`` shapes, or only those numbered in ``only`` (drawn as in a full suite, so one shape
    can be rerun as it was drawn)."""
    drawn = draw_suite(seed, max(count, *only) if only else count)
    return [s for s in drawn if s.index in only] if only else drawn


async def run_suite(seed: int, count: int, todo: list[Entry], fleet: FleetSpec, options: MeasureOptions,
                    budget_s: float, log_dir: Path, only: frozenset[int] = frozenset()) -> list[ShapeRun]:
    """Run the shapes one after the other, every kvmesh router and simulated fleet forked from one fork server."""
    out = []
    t0 = trio.current_time()
    async with zygote.running(log_dir):
        for shape in chosen_shapes(seed, count, only):
            print(f"suite shape {shape.label} at {trio.current_time() - t0:.0f} s", file=sys.stderr, flush=True)
            out.append(await run_shape(shape, todo, fleet, options, budget_s, log_dir))
    print(f"suite took {trio.current_time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out
