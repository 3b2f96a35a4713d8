"""A project process run as a child: started with bounded waits, identified by a ready line, always stopped.

The child binds its own ports (port 0, never guessed) and prints one line ``PREFIX <json>`` on stdout once
it serves; the parent reads the addresses from it. Stopping sends SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parent.parent


class ChildError(RuntimeError):
    """The child exited or did not announce itself in time; the message carries its stderr tail."""


def wait_for_ok(url: str, deadline: float) -> bool:
    """Poll ``url`` until it answers 200 or the monotonic ``deadline`` passes."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """``time_scale=0.1`` -> ``--time-scale 0.1``; True adds a bare flag; lists repeat the flag."""
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if item is True:
                argv.append(flag)
            elif item is not False and item is not None:
                argv += [flag, str(item)]
    return argv


class ChildProcess:
    def __init__(self, module: str, args: list[str], ready_prefix: str, start_timeout: float = 30.0,
                 env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", module, *args]
        self.ready_prefix = ready_prefix
        self.start_timeout = start_timeout
        self.env = env
        self.ready: Any = None
        self.proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Self:
        # Owned by this object and closed in stop(); a `with` block cannot span start() and stop().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=self.env, start_new_session=True)
        try:
            self.ready = self._read_ready(time.monotonic() + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_ready(self, deadline: float) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(left):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(self.ready_prefix):
                    return json.loads(line[len(self.ready_prefix):])
        raise ChildError(f"{' '.join(self.argv[2:4])} did not start (exit {self.proc.poll()}): "
                         f"{self.stderr()[-3000:]}")

    def stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        code = self.proc.returncode
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        self.proc = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
