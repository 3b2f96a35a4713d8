"""An engine's /health is asked once every few ticks while nobody uses it, and not while its events and /metrics
answers show it working; an engine that stops answering still leaves rotation within a few ticks."""

import threading
import time

import pytest
from gateway_http import Http, chat, metric, wait_for

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration

INTERVAL_S = 0.5
"""A quiet engine's /health is asked every fourth tick: every 2 s."""


def health_polls(client: Http, engine: str, outcome: str) -> float:
    return metric(client, "kvmesh_health_polls_total", engine=engine, outcome=outcome)


def test_health_polls_thin_out_while_idle_or_answered_and_a_dead_engine_still_leaves_rotation():
    with (SimFleetProcess(engines=1, profile="a40-qwen1.5b", time_scale=1.0) as kept,
          SimFleetProcess(engines=1) as dying,
          RouterProcess([*kept.urls, *dying.urls], metrics_interval=INTERVAL_S) as proc):
        client = Http(proc.url)
        busy, doomed = (url.removeprefix("http://") for url in (*kept.urls, *dying.urls))
        assert wait_for(lambda: all(health_polls(client, e, "quiet") >= 1 for e in (busy, doomed)), 10)
        before = [health_polls(client, e, "ok") for e in (busy, doomed)]
        time.sleep(4.0)  # 8 ticks: polled every tick, 8 polls; quiet, 2
        polled = [health_polls(client, e, "ok") - b for e, b in zip((busy, doomed), before, strict=True)]
        assert max(polled) <= 4, polled

        answered = health_polls(client, busy, "answered")
        done = threading.Event()

        def another_client() -> None:  # straight to the engine: its KV events show it working
            try:
                Http(kept.urls[0]).json("POST", "/v1/chat/completions", chat("a long answer", max_tokens=400))
            finally:
                done.set()

        thread = threading.Thread(target=another_client)
        thread.start()
        try:
            assert wait_for(lambda: health_polls(client, busy, "answered") > answered or done.is_set(), 15)
            assert health_polls(client, busy, "answered") > answered, "no tick was answered by events and /metrics"
        finally:
            thread.join(30)

        dying.stop()
        stopped = time.monotonic()
        # Its next poll (within four ticks) fails and the one at the tick after takes it out of rotation.
        assert wait_for(lambda: metric(client, "kvmesh_engine_healthy", engine=doomed) == 0, 8.0)
        assert time.monotonic() - stopped < 8.0
        assert health_polls(client, doomed, "failed") >= 2
        assert metric(client, "kvmesh_engine_healthy", engine=busy) == 1
