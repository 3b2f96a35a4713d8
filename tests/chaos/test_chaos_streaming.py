"""Engines killed under long streamed answers on a real local cluster (2 routers behind HAProxy, 3
engines): every stream is finished by another engine, so no client sees a failure."""

from __future__ import annotations

import pytest
from fresh_cluster import chaos_on_fresh_cluster


@pytest.mark.integration
@pytest.mark.mesh
def test_killing_engines_under_streaming_load_fails_no_client():
    code, data, _ = chaos_on_fresh_cluster(["--routers", "2", "--engines", "3"],
                                           ["kill-engine-streaming", "--duration", "28", "--rate", "6"])
    assert data["requests"]["failed"] == 0 and data["requests"]["ok"] > 0
    assert data["invariants"]["no_client_visible_failure_while_an_engine_lives"]
    assert data["continuations"]["streams"] > 0 and data["continuations"]["latency_p99_ms"] is not None
    assert all(data["invariants"].values()), (data["invariants"], data["violations"], data["undetermined"])
    assert code == 0
