"""Run a simulated fleet in a child process, for integration tests and benchmarks.

    with SimFleetProcess(engines=2, profile="fast") as fleet:
        fleet.urls  # ["http://127.0.0.1:PORT", ...], all answering /health

Ports are chosen by the child (bound to port 0, never guessed), start-up and shutdown are bounded,
and the child is killed if it does not stop on SIGTERM.
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
from typing import Any

from sim.cli import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent


class SimFleetError(RuntimeError):
    pass


class SimFleetProcess:
    """A `kvmesh sim` child process; extra keyword arguments become CLI flags (`time_scale=0.1`)."""

    def __init__(self, engines: int = 1, start_timeout: float = 30.0, **flags: Any) -> None:
        self.argv = [sys.executable, "-m", "sim.cli", "--engines", str(engines), "--base-port", "0"]
        for name, value in flags.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                self.argv.append(flag)
            elif value not in (False, None):
                self.argv += [flag, str(value)]
        self.start_timeout = start_timeout
        self.engines: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None

    @property
    def urls(self) -> list[str]:
        return [e["url"] for e in self.engines]

    def start(self) -> SimFleetProcess:
        # Owned by this object and closed in stop(); a `with` block cannot span start() and stop().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True)
        deadline = time.monotonic() + self.start_timeout
        try:
            self.engines = self._read_ready(deadline)
            for url in self.urls:
                self._wait_healthy(url, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_ready(self, deadline: float) -> list[dict[str, Any]]:
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(left):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(READY_PREFIX):
                    return json.loads(line[len(READY_PREFIX):])
        raise SimFleetError(f"sim fleet did not start (exit {self.proc.poll()}): {self.stderr()[-2000:]}")

    def _wait_healthy(self, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise SimFleetError(f"{url}/health not ready in {self.start_timeout}s")

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        self.proc = None

    def __enter__(self) -> SimFleetProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
