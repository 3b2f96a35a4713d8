"""``python -m bench.synthetic_publisher``: the KV-event publishers of E synthetic engines in one process.

Real ZeroMQ with vLLM's framing (sim/publisher.py: PUB for live batches, ROUTER answering replays), so
router replicas subscribe to it exactly as to vLLM. The benchmark drives it by line commands on stdin;
every command is answered by one JSON line on stdout:

- ``run RATE SECONDS``: publish at RATE block ops/s (all engines together, round robin) for SECONDS;
- ``fill RATE SECONDS``: the same, but stopping early once every engine holds its cap;
- ``prepare RATE SECONDS``: generate (without sending) what the next ``run RATE SECONDS`` publishes, so that run
  costs this process only ZeroMQ sends and pacing (~6.4 us of CPU per block op less: at 150k ops/s that is a
  core the replicas under test would otherwise share); the run then sends all of it, even a little past SECONDS
  when it fell behind, so the engines' live sets stay what was sent;
- ``state``: per engine the digest and count of its live blocks and the next seq.

A ``run``/``fill`` answer carries the monotonic publish time of every batch it sent, per engine in seq
order, so the benchmark can tell how old the oldest batch a replica has not applied yet is. The first
line (before any command) lists the engines' endpoints. End of stdin stops the process.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from collections import deque
from typing import Any

import trio
import zmq

from bench.event_mix import MixBatch, MixEngine
from bench.synthetic_engines import Batch, Pacer, SyntheticEngine
from sim.publisher import EventPublisher

HOST = "127.0.0.1"
TOPIC = "kv"
MIN_SLEEP_S = 0.001
REPLAY_BUFFER_STEPS = 10_000
CHECKPOINT_BATCHES = 64


class Fleet:
    """The engines and their publishers; publishes paced phases and reports what it sent."""

    def __init__(self, engines: list[SyntheticEngine] | list[MixEngine], publishers: list[EventPublisher]) -> None:
        self.engines = engines
        self.publishers = publishers
        self._next = 0
        self._prepared: deque[tuple[int, MixBatch | Batch]] = deque()
        """Generated batches not sent yet (``prepare``), in the engines' round-robin order."""

    def _generate(self) -> tuple[int, MixBatch | Batch]:
        i = self._next
        self._next = (i + 1) % len(self.engines)
        return i, self.engines[i].next_batch(time.time())

    def prepare(self, rate: float, seconds: float) -> dict[str, Any]:
        """Generate ``rate * seconds`` block ops ahead of the run that sends them."""
        started = time.monotonic()
        ops, wanted = sum(b.ops for _, b in self._prepared), rate * seconds
        while ops < wanted:
            item = self._generate()
            self._prepared.append(item)
            ops += item[1].ops
        return {"prepared_ops": ops, "batches": len(self._prepared), "seconds": time.monotonic() - started}

    def endpoints(self) -> list[dict[str, str]]:
        return [{"events": f"tcp://{HOST}:{p.port}", "replay": f"tcp://{HOST}:{p.replay_port}", "topic": TOPIC}
                for p in self.publishers]

    async def publish(self, rate: float, seconds: float, until_full: bool = False) -> dict[str, Any]:
        """Paced publishing for ``seconds`` (or until every engine is full, if asked)."""
        start = time.monotonic()
        pacer = Pacer(rate, start)
        times: list[list[float]] = [[] for _ in self.engines]
        first_seq = [p.seq for p in self.publishers]
        ops = stored = removed = sent_bytes = 0
        behind = 0.0
        while True:
            now = time.monotonic()
            if (now - start >= seconds and not self._prepared) or (until_full and self.full):
                break
            wait = pacer.wait_s(now, ops)
            if wait > 0:
                await trio.sleep(max(MIN_SLEEP_S, wait))
                continue
            behind = max(behind, pacer.behind_s(now, ops))
            if self._prepared:
                i, batch = self._prepared.popleft()
                self.publishers[i].publish(stamped(batch.payload, time.time()))
            else:
                i, batch = self._generate()
                self.publishers[i].publish(batch.payload)
            sent_bytes += len(batch.payload)
            times[i].append(round(time.monotonic(), 5))
            ops, stored, removed = ops + batch.ops, stored + batch.stored, removed + batch.removed
            if sum(map(len, times)) % CHECKPOINT_BATCHES == 0:
                await trio.lowlevel.checkpoint()  # let replay requests in while catching up
        elapsed = time.monotonic() - start
        return {"ops": ops, "stored": stored, "removed": removed, "full": self.full, "seconds": elapsed,
                "ops_per_s": ops / elapsed if elapsed > 0 else 0.0, "behind_s": behind,
                "first_seq": first_seq, "times": times, "bytes": sent_bytes}

    @property
    def full(self) -> bool:
        return all(e.full for e in self.engines)

    def state(self) -> dict[str, Any]:
        return {"engines": [{"digest": e.digest(), "blocks": e.live, "next_seq": p.seq}
                            for e, p in zip(self.engines, self.publishers, strict=True)]}


_FLOAT_TS = b"\x93\xcb"
"""A batch ``[ts, events, rank]`` whose ts is a msgpack float64: its 8 bytes follow at once."""


def stamped(payload: bytes, ts: float) -> bytes:
    """A prepared batch with its send time as ``ts``, as vLLM stamps a batch when it publishes it."""
    if not payload.startswith(_FLOAT_TS):
        return payload
    return _FLOAT_TS + struct.pack(">d", ts) + payload[10:]


async def _commands(fleet: Fleet) -> None:
    """Answer stdin commands until end of input."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buffer = b""
    while True:
        chunk = await stdin.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            print(json.dumps(await _answer(fleet, line.decode().split())), flush=True)


async def _answer(fleet: Fleet, words: list[str]) -> dict[str, Any]:
    try:
        if words[:1] == ["run"] and len(words) == 3:
            return await fleet.publish(float(words[1]), float(words[2]))
        if words[:1] == ["fill"] and len(words) == 3:
            return await fleet.publish(float(words[1]), float(words[2]), until_full=True)
        if words[:1] == ["prepare"] and len(words) == 3:
            return fleet.prepare(float(words[1]), float(words[2]))
        if words == ["state"]:
            return fleet.state()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": f"unknown command {' '.join(words)!r}"}


async def serve(args: argparse.Namespace) -> None:
    ctx = zmq.Context.instance()
    kind = MixEngine if args.mix == "realistic" else SyntheticEngine
    first = args.first_engine
    engines = [kind(i, args.cap, args.model, args.encoding, args.seed) for i in range(first, first + args.engines)]
    publishers = [EventPublisher(ctx, HOST, 0, 0, TOPIC, buffer_steps=REPLAY_BUFFER_STEPS)
                  for _ in range(args.engines)]
    fleet = Fleet(engines, publishers)
    try:
        async with trio.open_nursery() as nursery:
            for publisher in publishers:
                nursery.start_soon(publisher.serve_replay)
            print(json.dumps({"engines": fleet.endpoints()}), flush=True)
            await _commands(fleet)
            nursery.cancel_scope.cancel()
    finally:
        for publisher in publishers:
            publisher.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic_publisher", description=__doc__)
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--first-engine", type=int, default=0,
                   help="index of this process's first engine (several processes play one fleet between them)")
    p.add_argument("--cap", type=int, default=16384, help="live blocks per engine before evictions start")
    p.add_argument("--model", default="kvmesh-tiny", help="the model the routers key the engines' blocks under")
    p.add_argument("--encoding", choices=["map", "array"], default="map")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", choices=["realistic", "chains"], default="realistic",
                   help="bench/event_mix.py, or chains of 32 blocks with one removal per evicted block")
    args = p.parse_args(argv)
    trio.run(serve, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
