"""The CI chaos run: a real local cluster (3 routers behind HAProxy, 3 engines, Redis), 60 s of the mixed
scenario under load, and every invariant of the report must hold."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from gateway.cli import main as kvmesh


@pytest.mark.integration
@pytest.mark.mesh
def test_mixed_chaos_keeps_every_invariant():
    # Not tmp_path: concurrent pytest sessions prune old basetemp folders, and a restarted router needs
    # the state folder (mesh secret, logs) for the whole run.
    work = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    state, report = str(work / "state"), work / "chaos.json"
    try:
        assert kvmesh(["up", "--routers", "3", "--engines", "3", "--redis", "--state-dir", state]) == 0
        try:
            code = kvmesh(["chaos", "mixed", "--duration", "60", "--state-dir", state, "--report", str(report)])
        finally:
            assert kvmesh(["down", "--state-dir", state]) == 0
        data = json.loads(report.read_text())
        page = report.with_suffix(".md").read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert page.startswith("# kvmesh chaos: mixed")
    assert {f["kind"] for f in data["faults"]} == {"kill-router", "kill-engine", "pause-engine", "pause-router",
                                                   "restart-engine", "partition-router", "kill-redis", "drop-events"}
    assert data["requests"]["ok"] > 0.9 * data["requests"]["total"]
    assert all(data["invariants"].values()), (data["invariants"], data["violations"], data["undetermined"])
    assert code == 0
