"""Run a simulated fleet in a child process, for integration tests and benchmarks.

    with SimFleetProcess(engines=2, profile="fast") as fleet:
        fleet.urls  # ["http://127.0.0.1:PORT", ...], all answering /health

Ports are chosen by the child (bound to port 0, never guessed); start-up and shutdown are bounded by
``cluster.child.ChildProcess``.
"""

from __future__ import annotations

import time
from typing import Any, Self

from cluster.child import ChildError, ChildProcess, flags_to_argv, wait_for_ok
from sim.cli import READY_PREFIX

SimFleetError = ChildError


class SimFleetProcess(ChildProcess):
    """A `kvmesh sim` child process; extra keyword arguments become CLI flags (`time_scale=0.1`)."""

    def __init__(self, engines: int = 1, start_timeout: float = 30.0, **flags: Any) -> None:
        args = ["--engines", str(engines), "--base-port", "0", *flags_to_argv(flags)]
        super().__init__("sim.cli", args, READY_PREFIX, start_timeout)

    @property
    def engines(self) -> list[dict[str, Any]]:
        return self.ready or []

    @property
    def urls(self) -> list[str]:
        return [e["url"] for e in self.engines]

    def start(self) -> Self:
        super().start()
        deadline = time.monotonic() + self.start_timeout
        try:
            for url in self.urls:
                if not wait_for_ok(url + "/health", deadline):
                    raise SimFleetError(f"{url}/health not ready in {self.start_timeout}s")
        except BaseException:
            self.stop()
            raise
        return self
