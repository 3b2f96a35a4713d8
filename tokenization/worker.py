"""Tokenizer worker processes, so that long encodes never hold the router's GIL.

Each worker is a fresh interpreter (``python -m tokenization.worker``, started with fork+exec, so
nothing of the parent's trio loop or threads is inherited, and unlike multiprocessing's spawn it never
re-imports the parent's main module). It talks to the router over an inherited socketpair with
length-prefixed pickle frames: request ``(spec, texts)``, answer ``("ok", [int32 ids bytes, ...])`` or
``("error", message)``. The trio side only ever awaits the socket, so the event loop keeps running
while a worker encodes 32k tokens. One request is in flight per worker. Jobs wait in a fair queue
(tokenization/fair_queue.py): each requester (the tenant a request came from, ``REQUESTER``) has its own
bounded FIFO and requesters take turns, a job that waited past its deadline is answered
``TokenizerBusy`` instead of run, and a job whose caller went away is dropped unrun. A worker that dies
is replaced and the job it held fails with ``WorkerError`` (the caller may retry or tokenize another way).
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import socket
import struct
import sys
from array import array
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import trio

from tokenization.fair_queue import FairQueue

HEADER = struct.Struct("!I")
READY = b"ready"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 2.0
RESTART_DELAY_S = 0.5


REQUESTER: ContextVar[str] = ContextVar("tokenizer_requester", default="")
"""Who the current task encodes for (the router sets the tenant per request): the fair queue's key."""
PER_REQUESTER_JOBS = 8
"""Jobs one requester may have waiting; beyond, its next long prompt is refused at once."""
JOB_DEADLINE_S = 30.0
"""A job not started by then is refused rather than run for a caller that has likely given up."""


def default_workers() -> int:
    """Worker processes for this machine: half its cores (the router's loop and engines need the rest), 1-4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


class WorkerError(RuntimeError):
    """A job could not be done by a worker (it died, or its tokenizer failed)."""


class TokenizerBusy(Exception):
    """A job refused without running: its requester has too many waiting, or it waited too long."""

    def __init__(self, message: str, own_load: bool) -> None:
        super().__init__(message)
        self.own_load = own_load
        """True when the requester's own queue is full (its load, a 429), False when the pool is slow."""


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
    deadline: float = math.inf
    done: trio.Event = field(default_factory=trio.Event)
    result: list[list[int]] | None = None
    error: str | None = None
    expired: bool = False
    abandoned: bool = False
    """The caller stopped waiting (its client went away): the job is dropped if it has not started."""


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
    """``size`` spawned tokenizer processes fed from a fair queue; run it with ``nursery.start``."""

    def __init__(self, specs: Sequence[str], size: int = 1, per_requester: int = PER_REQUESTER_JOBS,
                 deadline_s: float = JOB_DEADLINE_S) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        self.specs = list(specs)
        self.size = size
        self.deadline_s = deadline_s
        self.restarts = 0
        self.dropped: dict[str, int] = {"abandoned": 0, "expired": 0, "refused": 0}
        self.pids: set[int] = set()
        """Process ids of the running workers (for monitoring and fault-injection tests)."""
        self._queue: FairQueue[Job] = FairQueue(per_requester)
        self._wake_send, self._wake = trio.open_memory_channel[None](math.inf)
        """One token per queued job: a free worker takes a token, then the job whose turn it is."""

    async def encode(self, spec: str, texts: list[str]) -> list[list[int]]:
        """Ids of each text (no special tokens added), computed in a worker process for ``REQUESTER``.

        Raises TokenizerBusy when the requester has too many jobs waiting or this one waited too long."""
        job = Job(spec, texts, deadline=trio.current_time() + self.deadline_s)
        requester = REQUESTER.get()
        if not self._queue.push(requester, job):
            self.dropped["refused"] += 1
            raise TokenizerBusy(f"{self._queue.per_requester} long prompts of this requester are already waiting "
                                "for the tokenizer", own_load=True)
        self._wake_send.send_nowait(None)
        try:
            await job.done.wait()
        except BaseException:
            job.abandoned = True
            raise
        if job.expired:
            raise TokenizerBusy(f"the tokenizer did not start this prompt within {self.deadline_s:g}s",
                                own_load=False)
        if job.result is None:
            raise WorkerError(job.error or "worker failed")
        return job.result

    def _next_job(self) -> Job | None:
        """The next job to run: abandoned ones are dropped, late ones answered as expired."""
        job = self._queue.pop()
        if job is None:
            return None
        if job.abandoned:
            self.dropped["abandoned"] += 1
            return None
        if trio.current_time() > job.deadline:
            self.dropped["expired"] += 1
            job.expired = True
            job.done.set()
            return None
        return job

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
        async for _ in self._wake:
            job = self._next_job()
            if job is None:
                continue
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
