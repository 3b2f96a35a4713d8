"""The loop inside a real router process: it provisions a local simulated engine, which is routed to."""

import json
import urllib.request

import pytest

from autoscale.signals import histogram_quantile
from cluster.router_process import RouterProcess
from sim.process import SimFleetProcess


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_until(predicate, timeout: float, step: float = 0.2):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def test_histogram_quantile_between_snapshots():
    before = {0.1: 10, 1.0: 10, float("inf"): 10}
    after = {0.1: 10, 1.0: 110, float("inf"): 110}
    assert histogram_quantile(0.5, before, after) == pytest.approx(0.55)
    assert histogram_quantile(0.99, before, before) is None


AUTOSCALER_TOML = """
[autoscaler]
enabled = true
interval_s = 0.5
min_engines = 2
max_engines = 3
sim_args = ["--profile", "fast"]
[[autoscaler.offers]]
name = "sim"
price_per_hour = 1.0
capacity = 4
provisioning_s = 0
"""


@pytest.mark.integration
def test_router_provisions_a_local_engine_up_to_min_engines(tmp_path):
    config = tmp_path / "kvmesh.toml"
    config.write_text(AUTOSCALER_TOML)
    with SimFleetProcess(engines=1, profile="fast") as fleet, \
            RouterProcess(fleet.urls, config=str(config), metrics_interval=0.2) as router:
        def routable_local():
            rows = get(router.url + "/admin/engines")["engines"]
            return [r for r in rows if r["id"].startswith("local-") and r["healthy"] and r["models"]]
        assert wait_until(routable_local, 60), get(router.url + "/admin/engines")
        report = get(router.url + "/admin/autoscaler")
        assert report["acting"] and report["managed"] == [routable_local()[0]["id"]]
        # the report keeps the last 20 decisions (10 s here): on a busy machine the engine may take longer
        # to serve, so the scale-up is read from the counter of all decisions
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as response:
            assert b'kvmesh_autoscaler_decisions_total{action="up"} 1.0' in response.read()


def test_a_fresh_engine_has_no_hit_ratio_yet():
    from gateway.engines import PrefixReuse
    reuse = PrefixReuse()
    assert not reuse.measured
    reuse.record(100, 0)
    reuse.record(200, 50)
    assert reuse.measured and reuse.ratio == 0.5
