"""Daemonised child processes: they outlive the command that started them and are found again by pid.

Each runs in its own session (its pid is the session id, so stopping the session also stops its
children, e.g. a router's tokenizer workers, even when the leader was killed first) and writes stdout
and stderr to a log file. A process
record keeps the kernel's start time of the pid so a recycled pid is never signalled by mistake.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


class StartError(RuntimeError):
    """A process died or did not become ready in time; the message carries its log tail."""


@dataclass
class ProcessRecord:
    """Everything needed to find, stop, or restart one process identically."""

    role: str
    name: str
    argv: list[str]
    log: str
    pid: int = 0
    start_ticks: int = 0
    url: str | None = None
    ports: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = str(REPO_ROOT)


def _stat_fields(stat_file: Path) -> list[str] | None:
    """The fields of a /proc stat file after the command name (state ppid pgrp session ...)."""
    try:
        return stat_file.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _exited(proc_dir: Path) -> bool:
    """True once every thread has exited.

    A killed multi-threaded process shows its main thread as a zombie while the other threads are still
    tearing down, and its open files (a listening socket) close only when the last one is gone: until
    then the kernel still accepts connections on that socket and resets them a few ms later.
    """
    try:
        tasks = list((proc_dir / "task").iterdir())
    except OSError:
        return True
    return all((fields := _stat_fields(task / "stat")) is None or fields[0] in ("Z", "X") for task in tasks)


def start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone."""
    proc_dir = Path(f"/proc/{pid}")
    fields = _stat_fields(proc_dir / "stat")
    if fields is None or _exited(proc_dir):
        return None
    return int(fields[19])


def alive(record: ProcessRecord) -> bool:
    """True while the recorded process (not a later one with the same pid) has a thread not yet exited."""
    return record.pid > 0 and start_ticks(record.pid) == record.start_ticks


def session_members(record: ProcessRecord) -> list[int]:
    """Live processes of the record's session (its own children too, even after it died itself)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry / "stat")
        if fields is not None and int(fields[3]) == record.pid and not _exited(entry):
            pid = int(entry.name)
            if pid != record.pid or int(fields[19]) == record.start_ticks:  # the leader, not a recycled pid
                members.append(pid)
    return members


def spawn(record: ProcessRecord) -> ProcessRecord:
    """Start ``record.argv`` detached (new session, stdin closed, output appended to its log)."""
    log_path = Path(record.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **record.env}
    with log_path.open("ab") as log:
        log.write(f"\n=== kvmesh: starting {record.name} at {time.strftime('%H:%M:%S')} ===\n".encode())
        log.flush()
        proc = subprocess.Popen(
            record.argv,
            cwd=record.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record.pid = proc.pid
    record.start_ticks = start_ticks(proc.pid) or 0
    return record


def log_tail(record: ProcessRecord, lines: int = 30) -> str:
    try:
        return "\n".join(Path(record.log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check_alive(record: ProcessRecord) -> None:
    if not alive(record):
        raise StartError(f"{record.name} exited; log {record.log}:\n{log_tail(record)}")


def wait_ready_line(record: ProcessRecord, prefix: str, deadline: float) -> Any:
    """The JSON after ``prefix`` on the last such line of the log (a restart appends a new one)."""
    while time.monotonic() < deadline:
        with suppress(OSError):
            lines = Path(record.log).read_text(errors="replace").splitlines()
            run = lines[max(i for i, line in enumerate(lines) if line.startswith("=== kvmesh: starting")) :]
            found = [line for line in run if line.startswith(prefix)]
            if found:
                return json.loads(found[-1][len(prefix) :])
        _check_alive(record)
        time.sleep(0.05)
    raise StartError(f"{record.name} printed no ready line in time; log {record.log}:\n{log_tail(record)}")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def wait_http_ok(record: ProcessRecord, url: str, deadline: float) -> None:
    """Poll ``url`` until it answers 200; fail early, with the log, when the process died."""
    while time.monotonic() < deadline:
        _check_alive(record)
        if http_ok(url):
            return
        time.sleep(0.1)
    raise StartError(f"{url} of {record.name} not ready in time; log {record.log}:\n{log_tail(record)}")


def _signal(record: ProcessRecord, sig: signal.Signals) -> None:
    for pid in session_members(record):
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(records: list[ProcessRecord]) -> None:
    """Collect exit statuses of processes this very process started (otherwise they linger as zombies)."""
    for record in records:
        with suppress(ChildProcessError, OSError):
            os.waitpid(record.pid, os.WNOHANG)


def stop(records: list[ProcessRecord], grace: float = 10.0) -> list[ProcessRecord]:
    """SIGTERM every process session, SIGKILL those still alive after ``grace``; returns the survivors."""
    for record in records:
        _signal(record, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(records)
        if not any(session_members(r) for r in records):
            break
        time.sleep(0.05)
    for record in records:
        _signal(record, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(session_members(r) for r in records):
        _reap(records)
        time.sleep(0.05)
    return [r for r in records if session_members(r)]
