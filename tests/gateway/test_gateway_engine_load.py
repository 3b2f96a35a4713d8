"""The prefix-cache hit ratio a router derives from an engine's cumulative counters."""

from __future__ import annotations

import pytest

from gateway.engines import PrefixReuse


def test_ratio_follows_recent_increments_not_the_lifetime_total():
    reuse = PrefixReuse(fade=0.5)
    reuse.record(10_000, 9_000)  # a long history of hits before this router started
    assert reuse.ratio == 0.0
    reuse.record(11_000, 9_000)
    assert reuse.ratio == 0.0
    for step in range(1, 8):
        reuse.record(11_000 + 1_000 * step, 9_000 + 800 * step)
    assert reuse.ratio == pytest.approx(0.8, abs=0.01)


def test_a_restarted_engine_resets_the_baseline_only():
    reuse = PrefixReuse()
    reuse.record(1_000, 500)
    reuse.record(2_000, 1_000)
    assert reuse.ratio == pytest.approx(0.5)
    reuse.record(100, 0)  # counters went backwards: restarted
    assert reuse.ratio == pytest.approx(0.5)
    reuse.record(1_100, 1_000)
    assert 0.5 < reuse.ratio <= 1.0
