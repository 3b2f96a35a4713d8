"""Host many simulated engines in one trio process (one nursery owns them all)."""

from __future__ import annotations

import trio
import zmq

from sim.config import FleetConfig
from sim.engine import EngineInfo, SimEngine
from sim.tokenizer import SimTokenizer


async def run_fleet(
    config: FleetConfig, *, task_status: trio.TaskStatus[list[SimEngine]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Start every engine, report them (their `.info` says where they listen), serve until cancelled.

    Engines share the tokenizer and the zmq context; one engine dying (fault `die`) leaves the
    others running.
    """
    tokenizer = SimTokenizer(config.engine.tokenizer)
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:
            engines = []
            for cfg in config.engine_configs():
                engine = SimEngine(cfg, tokenizer, ctx)
                await nursery.start(engine.run)
                engines.append(engine)
            task_status.started(engines)
    finally:
        ctx.term()


def describe(infos: list[EngineInfo]) -> list[dict[str, object]]:
    """JSON-friendly listing of started engines (printed by the CLI, parsed by SimFleetProcess)."""
    return [{"index": i.index, "url": i.url, "port": i.port, "event_port": i.event_port,
             "replay_port": i.replay_port} for i in infos]
