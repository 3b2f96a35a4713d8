"""One chaos run on a local cluster of its own: ``kvmesh up``, ``kvmesh chaos``, ``kvmesh down``."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from gateway.cli import main as kvmesh


def chaos_on_fresh_cluster(up: list[str], chaos: list[str]) -> tuple[int, dict, str]:
    """``kvmesh up UP...`` then ``kvmesh chaos CHAOS...``; the exit code, the JSON report and its markdown.

    Not tmp_path: concurrent pytest sessions prune old basetemp folders, and a restarted router needs the
    state folder (mesh secret, logs) for the whole run."""
    work = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    state, report = str(work / "state"), work / "chaos.json"
    try:
        assert kvmesh(["up", *up, "--state-dir", state]) == 0
        try:
            code = kvmesh(["chaos", *chaos, "--state-dir", state, "--report", str(report)])
        finally:
            assert kvmesh(["down", "--state-dir", state]) == 0
        return code, json.loads(report.read_text()), report.with_suffix(".md").read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)
