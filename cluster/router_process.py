"""A ``kvmesh router`` child process for tests, benchmarks and the local cluster."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, Self

from cluster.child import ChildError, ChildProcess, flags_to_argv, wait_for_ok
from gateway.server import READY_PREFIX


class RouterProcess(ChildProcess):
    """``RouterProcess(engines=[url, ...], policy="kv_aware")``; keyword arguments become router flags.

    Start-up returns once the router listens and, unless ``wait_ready`` is False, once its ``/ready`` says
    an engine is routable (engines are discovered in the background)."""

    def __init__(self, engines: list[str], start_timeout: float = 60.0, env: dict[str, str] | None = None,
                 wait_ready: bool = True, **flags: Any) -> None:
        flags.setdefault("port", 0)
        super().__init__("gateway.cli", ["router", *flags_to_argv({"engine": engines, **flags})], READY_PREFIX,
                         start_timeout, env)
        self.wait_ready = wait_ready

    @property
    def url(self) -> str:
        return self.ready["url"]

    def start(self) -> Self:
        super().start()
        if self.wait_ready:
            try:
                self.await_ready(self.start_timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def await_ready(self, timeout: float) -> None:
        if not wait_for_ok(self.url + "/ready", time.monotonic() + timeout):
            raise ChildError(f"router {self.url} not ready after {timeout}s: {self.stderr()[-2000:]}")

    def await_all_routable(self, timeout: float = 30.0) -> Self:
        """``/ready`` holds once one engine is routable; tests that need every engine in rotation (round robin
        over all of them) wait, bounded, until ``/admin/engines`` lists each as healthy with its models."""
        deadline, listing = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            with urllib.request.urlopen(self.url + "/admin/engines", timeout=5) as response:
                listing = json.loads(response.read())
            if listing.get("engines") and all(e["healthy"] and e["models"] for e in listing["engines"]):
                return self
            time.sleep(0.05)
        raise ChildError(f"router {self.url}: engines not all routable after {timeout}s: {listing}")
