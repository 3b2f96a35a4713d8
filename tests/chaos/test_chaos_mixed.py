"""The CI chaos run: a real local cluster (3 routers behind HAProxy, 3 engines, Redis), 60 s of the mixed
scenario under load, and every invariant of the report must hold."""

from __future__ import annotations

import pytest
from fresh_cluster import chaos_on_fresh_cluster


@pytest.mark.integration
@pytest.mark.mesh
def test_mixed_chaos_keeps_every_invariant():
    code, data, page = chaos_on_fresh_cluster(["--routers", "3", "--engines", "3", "--redis"],
                                              ["mixed", "--duration", "60"])
    assert page.startswith("# kvmesh chaos: mixed")
    assert {f["kind"] for f in data["faults"]} == {"kill-router", "kill-engine", "pause-engine", "pause-router",
                                                   "restart-engine", "partition-router", "kill-redis", "drop-events"}
    assert data["requests"]["ok"] > 0.9 * data["requests"]["total"]
    assert all(data["invariants"].values()), (data["invariants"], data["violations"], data["undetermined"])
    assert code == 0
