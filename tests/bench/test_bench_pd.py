"""``kvmesh bench pd``'s arithmetic: the workload's shapes, TTFT and inter-token gaps, and the verdicts."""

import pytest

from bench.pd_workload import PdRow, PdWorkload, StreamTimes, summarize, verdicts


def test_requests_share_documents_and_ask_their_own_question():
    workload = PdWorkload(documents=3, doc_tokens=(40, 80), question_tokens=(5, 9), answer_tokens=(128, 512))
    docs = workload.docs()
    assert all(40 <= len(d.split()) <= 80 for d in docs)  # one token per word (bench/words.py)
    bodies = workload.requests(9, docs, "m")
    systems = [b["messages"][0]["content"] for b in bodies]
    assert sorted(systems) == sorted(docs * 3)
    assert len({b["messages"][1]["content"] for b in bodies}) == 9
    assert all(128 <= b["max_tokens"] <= 512 and b["stream"] for b in bodies)
    assert workload.requests(9, docs, "m") == bodies  # the same run twice sends the same requests


def test_itl_pools_every_gap_and_failed_requests_count_as_errors():
    runs = [StreamTimes([0.1, 0.2, 0.3], 3, True), StreamTimes([0.5, 0.5, 1.5], 3, True), StreamTimes([], 0, False)]
    row = summarize("s", 2, runs, 2.0, {})
    assert row.errors == 1 and row.ttft_p50 == pytest.approx(0.3) and row.tokens_per_s == 3.0
    assert row.itl_p50 == pytest.approx(0.1) and row.itl_p99 > 0.9  # gaps 0.1, 0.1, 0.0, 1.0


def _row(setup, c, ttft, itl):
    return PdRow(setup, c, 8, 0, ttft, ttft, itl, itl, 1.0, {})


def test_verdicts_judge_itl_at_the_top_concurrency_and_the_prefill_choice_at_each():
    rows = [_row("kvmesh P/D", 32, 0.2, 0.010), _row("kvmesh aggregated", 32, 0.1, 0.050),
            _row("round-robin P/D", 32, 0.4, 0.010), _row("kvmesh P/D", 1, 0.3, 0.01),
            _row("round-robin P/D", 1, 0.2, 0.01)]
    lines = verdicts(rows)
    assert "(lower, x5.00)" in lines[0]
    assert "c=1" in lines[1] and "NOT better" in lines[1] and "c=32" in lines[2] and "(better" in lines[2]


def test_repeated_rounds_are_judged_each_and_then_counted():
    rows = [_row("kvmesh P/D", 16, 0.2, 0.010), _row("kvmesh aggregated", 16, 0.1, 0.050),
            _row("round-robin P/D", 16, 0.4, 0.010)]
    second = [PdRow(r.setup, r.concurrency, 8, 0, r.ttft_p50, r.ttft_p50, r.itl_p50, r.itl_p99, 1.0, {}, round=1)
              for r in (_row("kvmesh P/D", 16, 0.5, 0.06), _row("kvmesh aggregated", 16, 0.1, 0.050),
                        _row("round-robin P/D", 16, 0.4, 0.010))]
    lines = verdicts(rows + second)
    assert lines[0].startswith("round 0: ITL p99") and lines[2].startswith("round 1: ITL p99")
    assert lines[-2].endswith("at c=16: 1 of 2 rounds (x5.00, x0.83)")
    assert lines[-1].endswith("at c=16: 1 of 2 rounds (x2.00, x0.80)")
