"""A fork server for benchmark children: one process imports the router's and the simulated engine's modules
once, and every child is forked from it instead of started as a fresh interpreter.

A routing suite starts about 16 Python processes per shape (a simulated fleet and one to three routers for each
entry); each spent about 2 s of CPU importing (transformers alone is most of it) before doing anything, about
half of a suite's time between runs on two cores. A forked child runs ``python -m MODULE ARGS`` exactly as a
fresh interpreter would (``runpy`` as ``__main__``, its own session, log file, working folder and CPUs), with
the imports already done. Only children that would inherit this process's environment and tree are forked:
any other ``spawned`` call starts a fresh interpreter as before (bench/processes.py).

Protocol, one Unix stream connection per child: the client sends a JSON line (module, args, log, cwd, cores),
the server answers ``pid N`` once forked and ``exit CODE`` (negative: killed by that signal, as
``subprocess`` reports it) when the child ends, then closes. The server exits when its standard input closes,
so it never outlives the benchmark that started it.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import traceback
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from contextvars import ContextVar
from pathlib import Path

import trio

PRELOADED = ("gateway.cli", "sim.cli")
"""Modules the server imports before forking: the suite's routers and simulated fleets."""


# --- server (runs in its own process) -------------------------------------------------------------------------


def _run_child(request: dict, log_fd: int) -> int:
    """In the forked child: become ``python -m module args`` in its own session; returns the exit code."""
    os.setsid()
    if request.get("cores"):
        os.sched_setaffinity(0, request["cores"])
    os.chdir(request["cwd"])
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.argv = [request["module"], *request["args"]]
    # The module was imported before the fork; running it again as __main__ is what ``python -m`` would do.
    warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the child reports any failure in its log and exit code, as python -m does
        traceback.print_exc()
        return 1
    return 0


def _fork(request: dict, inherited: list) -> int:
    """Fork a child for ``request``; in the child, close what the server holds (``inherited``: objects with
    ``close``, or fds) and run it. Returns the child's pid."""
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for held in inherited:
            os.close(held) if isinstance(held, int) else held.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        code = _run_child(request, log_fd)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(path: str) -> None:
    """Accept fork requests on the abstract Unix socket ``path`` until standard input closes."""
    for module in PRELOADED:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + path)
    listener.listen(64)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    conns: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(read_end, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                return
            if key.data == "child":
                os.read(read_end, 4096)
                _reap(conns)
                continue
            conn, _ = listener.accept()
            try:
                conn.settimeout(10)
                request = json.loads(conn.makefile("rb").readline())
                pid = _fork(request, [selector, listener, read_end, write_end, conn, *conns.values()])
                conn.sendall(f"pid {pid}\n".encode())
                conns[pid] = conn
            except (OSError, ValueError, KeyError) as exc:
                with suppress(OSError):
                    conn.sendall(f"error {exc!r}\n".encode())
                conn.close()
        _reap(conns)


def _reap(conns: dict[int, socket.socket]) -> None:
    """Tell each ended child's client its exit code."""
    while conns:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = conns.pop(pid, None)
        if conn is not None:
            with suppress(OSError):
                conn.sendall(f"exit {_exit_code(status)}\n".encode())
            conn.close()


# --- client (in the benchmark) ---------------------------------------------------------------------------------


class ForkedProcess:
    """What ``bench.processes`` uses of a ``trio.Process`` (pid, args, returncode, signals, wait), for a child
    forked by the server."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self._conn = conn
        self._buffer = b""
        self._returncode: int | None = None
        self._server_gone = False

    def _take(self, data: bytes) -> None:
        self._buffer += data
        if self._returncode is None and b"\n" in self._buffer:
            word, _, value = self._buffer.partition(b"\n")[0].partition(b" ")
            self._returncode = int(value) if word == b"exit" else -1
        elif not data and self._returncode is None:
            self._returncode, self._server_gone = -1, True  # no exit code will come; the child may live on

    @property
    def returncode(self) -> int | None:
        if self._returncode is None:
            with suppress(BlockingIOError):
                self._take(self._conn.recv(64))
        return self._returncode

    async def wait(self) -> int:
        while self.returncode is None:
            await trio.lowlevel.wait_readable(self._conn)
        self._conn.close()
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None or self._server_gone:
            with suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A running fork server."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def spawn(self, module: str, args: Sequence[str], log: Path, cwd: Path,
                    cores: frozenset[int] | None) -> ForkedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + self.path)  # a listening Unix socket accepts at once
        request = {"module": module, "args": list(args), "log": str(log), "cwd": str(cwd),
                   "cores": sorted(cores) if cores else None}
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.setblocking(False)
        line = b""
        while not line.endswith(b"\n"):
            await trio.lowlevel.wait_readable(conn)
            data = conn.recv(1)  # byte by byte: the exit line may follow in the same segment
            if not data:
                break
            line += data
        word, _, value = line.strip().partition(b" ")
        if word != b"pid":
            conn.close()
            raise OSError(f"fork server refused {module}: {line.decode(errors='replace').strip()}")
        return ForkedProcess([sys.executable, "-m", module, *args], int(value), conn)


ACTIVE: ContextVar[Zygote | None] = ContextVar("zygote", default=None)
"""The fork server ``spawned`` forks from, when one runs (set by ``running``)."""


@asynccontextmanager
async def running(log_dir: Path) -> AsyncIterator[Zygote]:
    """Start a fork server for the duration of the block; ``spawned`` forks preloaded modules from it."""
    path = f"kvmesh-zygote-{os.getpid()}-{id(log_dir)}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "zygote.log").open("wb") as log:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "bench.zygote", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        with trio.fail_after(60):
            ready = await proc.stdout.receive_some(64)
        if not ready.startswith(b"ready"):
            raise OSError(f"fork server did not start (see {log_dir / 'zygote.log'})")
        zygote = Zygote(path)
        token = ACTIVE.set(zygote)
        try:
            yield zygote
        finally:
            ACTIVE.reset(token)
    finally:
        with trio.CancelScope(shield=True):
            await proc.stdin.aclose()
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
