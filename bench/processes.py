"""Child processes for a benchmark run: start, wait until they answer, always stop them.

Each child gets its own log file so a failed start can be explained, and runs in its own session so
stopping it never signals the benchmark itself.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from bench import zygote
from bench.client import TRANSPORT_ERRORS, HttpClient

REPO_ROOT = Path(__file__).resolve().parents[1]
Child = trio.Process | zygote.ForkedProcess
"""A started child: a fresh interpreter, or forked from the fork server."""


class StartFailed(RuntimeError):
    """A child exited or never became ready; the message carries the end of its log."""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PORTS = (10000, 32768)
"""Where children's ports are drawn: below Linux's ephemeral range (32768-60999), where every outgoing
connection of a run takes a port, and one took a simulated engine's event port between the check and the bind
(a suite starting five fleets at once failed so twice in eight shapes)."""
_HANDED_OUT: set[int] = set()
"""Ports this process already handed out: a fleet started while another one is starting finds the other's
ports still free (nothing is bound until the child has imported its modules) and must not take them."""


def free_port_range(
    count: int, offsets: tuple[int, ...] = (0,), rng: random.Random | None = None, attempts: int = 200
) -> int:
    """A base port with ``count`` consecutive free ports after ``base + offset`` for every offset, none of them
    handed out before by this process.

    A simulated fleet needs runs of ports: HTTP at base+i, its event sockets at fixed offsets.
    """
    rng = rng or random.Random()
    for _ in range(attempts):
        base = rng.randrange(PORTS[0], PORTS[1] - count - max(offsets))
        ports = {base + o + i for o in offsets for i in range(count)}
        if not ports & _HANDED_OUT and all(_bindable(p) for p in ports):
            _HANDED_OUT.update(ports)
            return base
    raise StartFailed(f"no run of {count} free ports found")


def free_udp_port() -> int:
    """A UDP port on loopback nobody holds right now (for a router's gossip socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs a project module with the current interpreter."""
    return [sys.executable, "-m", module, *args]


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@asynccontextmanager
async def spawned(argv: list[str], log_path: Path, env: Mapping[str, str] | None = None,
                  cores: frozenset[int] | None = None, root: Path | None = None,
                  grace: float = 5.0) -> AsyncIterator[Child]:
    """Run ``argv`` from the repository root (or ``root``, another revision's tree, which its modules are then
    imported from) for the duration of the block, then stop it. With ``cores`` the child (and every thread it
    starts) runs only on those CPUs; without, it inherits this process's. On leaving, the child has ``grace``
    seconds to exit after SIGTERM before it is killed. A preloaded module of this tree with
    this process's environment is forked from the fork server when one runs (bench/zygote.py)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = await _forked(argv, log_path, env, cores, root) or await _started(argv, log_path, env, cores, root)
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            await stop(proc, grace)


async def _forked(argv: list[str], log_path: Path, env: Mapping[str, str] | None, cores: frozenset[int] | None,
                  root: Path | None) -> zygote.ForkedProcess | None:
    """The child forked from the running fork server, when there is one and ``argv`` is a preloaded module of this
    tree run with this process's environment; None otherwise."""
    server = zygote.ACTIVE.get()
    if server is None or env is not None or root is not None or argv[:2] != [sys.executable, "-m"] \
            or argv[2] not in zygote.PRELOADED:
        return None
    return await server.spawn(argv[2], argv[3:], log_path, REPO_ROOT, cores)


async def _started(argv: list[str], log_path: Path, env: Mapping[str, str] | None, cores: frozenset[int] | None,
                   root: Path | None) -> trio.Process:
    """A fresh interpreter (or any program) for ``argv``, in its own session."""
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    if root is not None:
        env = {**(env if env is not None else os.environ), "PYTHONPATH": str(root)}
    with log_path.open("wb") as log:
        return await trio.lowlevel.open_process(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=str(root or REPO_ROOT), start_new_session=True,
            env=env, preexec_fn=pin,
        )


async def stop(proc: Child, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def wait_ready(
    client: HttpClient, url: str, proc: Child, log_path: Path, timeout: float = 60.0
) -> None:
    """Poll ``url`` until it answers 200; fail early, with the log, if the process died."""
    with trio.move_on_after(timeout):
        while True:
            if proc.returncode is not None:
                raise StartFailed(f"{proc.args!r} exited with {proc.returncode}:\n{_log_tail(log_path)}")
            try:
                with trio.fail_after(2.0):
                    if (await client.request(url)).status == 200:
                        return
            except (*TRANSPORT_ERRORS, trio.TooSlowError):
                pass
            await trio.sleep(0.1)
    raise StartFailed(f"{url} not ready after {timeout:.0f} s:\n{_log_tail(log_path)}")
