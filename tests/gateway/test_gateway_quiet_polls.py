"""An idle engine's /metrics is polled every few ticks; another client's requests on it, shown by its KV events,
bring its polls back to every tick, so the router still sees that load."""

import threading
import time

import pytest
from gateway_http import Http, chat, metric, wait_for

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration

INTERVAL_S = 0.5
"""A quiet engine is polled every fourth tick: every 2 s."""


def answered_polls(client: Http, engine: str) -> float:
    return metric(client, "kvmesh_metrics_polls_total", engine=engine, outcome="ok")


def depth(client: Http, engine: str) -> int:
    """The engine's queue depth as the router sees it (``/debug/route`` admits two calls a second, ten at once)."""
    status, _, table = client.json("POST", "/debug/route", chat("who is busy"))
    assert status == 200, table
    return next(c["queue_depth"] for c in table["candidates"] if c["engine"] == engine)


def test_an_idle_engine_is_polled_every_few_ticks_until_another_clients_request_runs_on_it():
    with (SimFleetProcess(engines=2, profile="a40-qwen1.5b", time_scale=1.0) as sims,
          RouterProcess(sims.urls, metrics_interval=INTERVAL_S) as proc):
        client = Http(proc.url)
        busy, idle = (url.removeprefix("http://") for url in sims.urls)
        assert wait_for(lambda: answered_polls(client, busy) >= 1 and answered_polls(client, idle) >= 1, 10)
        time.sleep(1.0)  # past the first polls, which show both engines idle
        before = answered_polls(client, busy), answered_polls(client, idle)
        time.sleep(4.0)  # 8 ticks: an engine polled every tick answers 8 polls, a quiet one 2
        quiet = answered_polls(client, busy) - before[0], answered_polls(client, idle) - before[1]
        assert max(quiet) <= 4, quiet

        last = answered_polls(client, busy)
        # A quiet poll just went: the next is 2 s on.
        assert wait_for(lambda: answered_polls(client, busy) > last, 3.0, step=0.05)
        done = threading.Event()

        def another_client() -> None:  # straight to the engine: the router sends nothing there
            try:
                Http(sims.urls[0]).json("POST", "/v1/chat/completions", chat("a long answer", max_tokens=400))
            finally:
                done.set()

        thread = threading.Thread(target=another_client)
        started = time.monotonic()
        thread.start()
        try:
            # Its prefill's KV events bring the poll back at the next tick (within 0.5 s of them), not 2 s on.
            assert wait_for(lambda: depth(client, busy) >= 1, 2.0, step=0.2), "the router never saw the other request"
            seen_after = time.monotonic() - started
            assert seen_after < 1.6, seen_after  # the next quiet poll: about 2 s
            start = answered_polls(client, busy), answered_polls(client, idle)
            time.sleep(2.0)  # 4 ticks
            assert not done.is_set()
            polled = answered_polls(client, busy) - start[0], answered_polls(client, idle) - start[1]
            assert polled[0] >= 3 and polled[1] <= 2, polled
        finally:
            thread.join(30)
        assert wait_for(lambda: depth(client, busy) == 0, 3.0, step=0.5)
