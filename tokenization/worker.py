"""Tokenizer worker processes, so that long encodes never hold the router's GIL.

Each worker is a fresh interpreter (``python -m tokenization.worker``, started with fork+exec, so
nothing of the parent's trio loop or threads is inherited, and unlike multiprocessing's spawn it never
re-imports the parent's main module). It talks to the router over an inherited socketpair with
length-prefixed pickle frames: request ``(spec, texts)``, answer ``("ok", [int32 ids bytes, ...])`` or
``("error", message)``. The trio side only ever awaits the socket, so the event loop keeps running
while a worker encodes 32k tokens. One request is in flight per worker; a bounded channel in front of
the pool gives backpressure. A worker that dies is replaced and the job it held fails with
``WorkerError`` (the caller may retry or tokenize another way).
"""

from __future__ import annotations

import pickle
import signal
import socket
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

HEADER = struct.Struct("!I")
READY = b"ready"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 2.0
RESTART_DELAY_S = 0.5


class WorkerError(RuntimeError):
    """A job could not be done by a worker (it died, or its tokenizer failed)."""


def _pack_ids(ids: Sequence[int]) -> bytes:
    return array("i", ids).tobytes()


def _unpack_ids(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes | None:
    header = _recv_exact(sock, HEADER.size)
    if header is None:
        return None
    return _recv_exact(sock, HEADER.unpack(header)[0])


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_frame(payload))


def _answer(spec: str, texts: list[str]) -> tuple[str, Any]:
    from tokenization.registry import encode_plain, load_tokenizer

    try:
        return "ok", [_pack_ids(ids) for ids in encode_plain(load_tokenizer(spec), texts)]
    except Exception as exc:  # a broken tokenizer or text must not kill the worker
        return "error", f"{type(exc).__name__}: {exc}"


def worker_main(sock: socket.socket, specs: list[str]) -> None:
    """Body of a worker process: load tokenizers, then answer requests until the socket closes."""
    from tokenization.registry import encode_plain, load_tokenizer

    for spec in specs:
        encode_plain(load_tokenizer(spec), ["warm up the encoder: its first call costs ~10 ms"])
    _send_frame(sock, READY)
    while (frame := _recv_frame(sock)) is not None:
        spec, texts = pickle.loads(frame)
        _send_frame(sock, pickle.dumps(_answer(spec, texts), protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class Job:
    """One batch of texts to encode with one tokenizer; the worker fills in ``result`` or ``error``."""

    spec: str
    texts: list[str]
    done: trio.Event = field(default_factory=trio.Event)
    result: list[list[int]] | None = None
    error: str | None = None


async def _recv_exact_async(stream: trio.SocketStream, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = await stream.receive_some(size - len(buf))
        if not chunk:
            raise trio.BrokenResourceError("worker closed its socket")
        buf += chunk
    return bytes(buf)


async def _recv_frame_async(stream: trio.SocketStream) -> bytes:
    (size,) = HEADER.unpack(await _recv_exact_async(stream, HEADER.size))
    return await _recv_exact_async(stream, size)


class WorkerPool:
    """``size`` spawned tokenizer processes fed from one bounded queue; run it with ``nursery.start``."""

    def __init__(self, specs: Sequence[str], size: int = 1, queue_size: int = 64) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        self.specs = list(specs)
        self.size = size
        self.restarts = 0
        self.pids: set[int] = set()
        """Process ids of the running workers (for monitoring and fault-injection tests)."""
        self._send, self._receive = trio.open_memory_channel[Job](queue_size)

    async def encode(self, spec: str, texts: list[str]) -> list[list[int]]:
        """Ids of each text (no special tokens added), computed in a worker process."""
        job = Job(spec, texts)
        await self._send.send(job)
        await job.done.wait()
        if job.result is None:
            raise WorkerError(job.error or "worker failed")
        return job.result

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker, report started once all are ready, and keep them alive until cancelled."""
        async with trio.open_nursery() as nursery:
            for _ in range(self.size):
                await nursery.start(self._supervise)
            task_status.started()

    async def _supervise(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            parent, child = socket.socketpair()
            command = [sys.executable, "-m", "tokenization.worker", str(child.fileno()), *self.specs]
            process: trio.Process | None = None
            try:
                process = await trio.lowlevel.open_process(command, pass_fds=(child.fileno(),))
                self.pids.add(process.pid)
                child.close()
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
                with trio.fail_after(START_TIMEOUT_S):
                    if await _recv_frame_async(stream) != READY:
                        raise WorkerError("worker sent an unexpected greeting")
                if first:
                    first = False
                    task_status.started()
                await self._serve(stream)
            except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
                if first:
                    raise WorkerError("a tokenizer worker failed to start") from exc
                self.restarts += 1
            finally:
                parent.close()
                child.close()
                if process is not None:
                    self.pids.discard(process.pid)
                    await _stop(process)
            await trio.sleep(RESTART_DELAY_S)

    async def _serve(self, stream: trio.SocketStream) -> None:
        async for job in self._receive:
            try:
                await stream.send_all(_frame(pickle.dumps((job.spec, job.texts))))
                status, payload = pickle.loads(await _recv_frame_async(stream))
            except BaseException:
                job.error = "tokenizer worker died"
                job.done.set()
                raise
            if status == "ok":
                job.result = [_unpack_ids(ids) for ids in payload]
            else:
                job.error = payload
            job.done.set()


async def _stop(process: trio.Process) -> None:
    """Wait for a worker to exit after its socket closed; kill it if it does not."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(STOP_TIMEOUT_S):
            await process.wait()
            return
        process.kill()
        await process.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenization.worker FD SPEC...``: serve the socket inherited as file descriptor FD."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_main(socket.socket(fileno=int(args[0])), args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
