"""The CPU a measured run cost: a real process's CPU between two marks, per request, and the machine's."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from bench import run_cpu

BURN = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_routers_cpu_between_two_marks_is_shared_over_the_requests():
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = run_cpu.mark([child.pid])
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        after = run_cpu.mark([child.pid])
        per_request = run_cpu.router_cpu_per_request(before, after, 3)
        assert 0.25 / 3 <= per_request < 5.0 / 3  # it burned at least 0.3 s of CPU between the marks
        assert math.isnan(run_cpu.router_cpu_per_request(before, after, 0))
    finally:
        child.communicate("\n")


def test_a_router_that_ended_between_the_marks_gives_no_figure():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                             text=True)
    before = run_cpu.mark([child.pid])
    child.communicate("\n")
    after = run_cpu.mark([child.pid])
    assert child.pid in before.routers and child.pid not in after.routers
    assert math.isnan(run_cpu.router_cpu_per_request(before, after, 10))
    assert math.isnan(run_cpu.router_cpu_per_request(run_cpu.mark([]), run_cpu.mark([]), 10))


def test_the_machine_busy_cores_come_from_its_jiffies(monkeypatch):
    monkeypatch.setattr(run_cpu.os, "cpu_count", lambda: 2)
    before = run_cpu.CpuMark({}, (100, 400))
    after = run_cpu.CpuMark({}, (250, 600))
    assert run_cpu.machine_busy_cores(before, after) == pytest.approx(1.5)
    assert math.isnan(run_cpu.machine_busy_cores(before, run_cpu.CpuMark({}, None)))
