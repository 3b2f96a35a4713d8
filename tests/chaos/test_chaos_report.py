"""The report: JSON that CI reads (strict JSON, no NaN) and a markdown page with every invariant."""

from __future__ import annotations

import json

from chaos import records as rec
from chaos.invariants import evaluate
from chaos.records import FaultAction, ProcessSample, RequestRecord, Sample
from chaos.report import build, write
from chaos.runner import ChaosOptions, ChaosRun
from chaos.scenarios import FaultEvent


def test_report_round_trips_and_names_the_violation(tmp_path):
    actions = [FaultAction(0, "kill-engine", rec.KILL, "engine", "engine-0", 5.0, 5.1, True, "", 7, "h:1"),
               FaultAction(0, "kill-engine", rec.RESTART, "engine", "engine-0", 7.0, 8.0, False, "boom", 9, "h:1")]
    records = [RequestRecord(0, 1.0, 1.5, 1.1, 1.2, 200, "h:2"), RequestRecord(1, 9.0, 9.1, status=503)]
    samples = [Sample(t / 2, processes={"router-0": ProcessSample(3, True, 1000, 10)}, indexes={"router-0": {}})
               for t in range(30)]
    evaluation = evaluate(records, actions, samples, ["router-0"], ["h:1", "h:2"], 15.0, 1.0)
    run = ChaosRun(ChaosOptions("kill-engine", 15.0), [FaultEvent("kill-engine", "engine", 0, 5.0, 7.0)],
                   records, 0, actions, samples, 15.0, evaluation)
    json_path, md_path = write(build(run), tmp_path / "out" / "r.json")
    data = json.loads(json_path.read_text())
    assert data["passed"] is False and data["failures_by_cause"] == {"router_error_503": 1}
    assert data["invariants"]["every_fault_applied"] is False
    assert data["faults"][0]["hit_rate_pre"] is None  # no counters sampled: NaN is written as null
    assert data["continuations"] == {"streams": 0, "latency_p50_ms": None, "latency_p99_ms": None}
    page = md_path.read_text()
    assert "No stream was under way on a killed engine." in page
    assert "(FAILED)" in page and "| router_error_503 | 1 | no |" in page and "boom" in page
