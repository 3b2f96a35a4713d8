"""Fixtures: simulated engines and a router, as real processes on loopback."""

import pytest
from gateway_http import Http

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as sims:
        yield sims


@pytest.fixture(scope="module")
def router(fleet):
    with RouterProcess(fleet.urls, policy="kv_aware", metrics_interval=0.2) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(router) -> Http:
    return Http(router.url)
