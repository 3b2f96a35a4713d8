"""ZeroMQ side of the KV events: PUB for live batches and a ROUTER answering replay requests.

Framing is vLLM's (see docs/vllm.md): live `[topic, seq u64 BE, payload]`; a DEALER sends
`[b"", start_seq u64 BE]` and receives `[b"", topic, seq, payload]` per buffered batch with
seq >= start, then the end marker `[b"", b"", b"\\xff"*8, b""]`. Sockets are driven from trio by
waiting on the zmq FD, which is edge-triggered: `zmq.EVENTS` is re-checked after every wakeup
and every send before waiting again.
"""

from __future__ import annotations

import logging
from collections import deque

import trio
import zmq

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
REPLAY_DRAIN = 64


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind to host:port (0 = any free port) and return the bound port."""
    sock.bind(f"tcp://{host}:{port if port else '*'}")
    return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


class EventPublisher:
    """One engine's publisher. `publish` never blocks: at the high-water mark PUB drops, as in vLLM."""

    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        replay_port: int,
        topic: str,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.topic = topic.encode()
        self.seq = 0
        self.drop = False
        self.malformed_replay_requests = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub = ctx.socket(zmq.PUB)
        self._router = ctx.socket(zmq.ROUTER)
        for s in (self._pub, self._router):
            s.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        try:
            self.port = _bind(self._pub, host, port)
            self.replay_port = _bind(self._router, host, replay_port)
        except zmq.ZMQError:
            self.close()
            raise

    def publish(self, payload: bytes) -> int:
        """Send one batch (unless the drop fault is on) and keep it for replay; return its seq."""
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if not self.drop:
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:
                log.debug("PUB queue full, batch %d dropped", seq)
        return seq

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.malformed_replay_requests += 1
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        try:
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self._router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])
        except zmq.ZMQError as exc:
            log.debug("replay answer aborted: %s", exc)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        fd = self._router.getsockopt(zmq.FD)
        while True:
            handled = 0
            while handled < REPLAY_DRAIN and self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._answer(frames)
                handled += 1
            if handled:
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(fd)

    def close(self) -> None:
        """Close both sockets; call after `serve_replay` has been cancelled."""
        for s in (self._pub, self._router):
            s.close(linger=0)
