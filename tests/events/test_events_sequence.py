"""SequenceTracker against a model publisher with lost live messages, replays and restarts."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from events.sequence import Decision, SequenceTracker


@st.composite
def scenario(draw):
    epochs = draw(st.lists(st.integers(1, 25), min_size=1, max_size=3))
    published = [(e, s) for e, n in enumerate(epochs) for s in range(n)]
    delivered = draw(st.lists(st.booleans(), min_size=len(published), max_size=len(published)))
    delays = draw(st.lists(st.integers(0, 3), min_size=len(published), max_size=len(published)))
    failures = draw(st.lists(st.booleans(), min_size=len(published), max_size=len(published)))
    buffer_len = draw(st.integers(1, 30))
    return published, delivered, delays, failures, buffer_len


def run(published, delivered, delays, failures, buffer_len, max_buffered=10_000):
    tracker: SequenceTracker[tuple[int, int]] = SequenceTracker(max_buffered=max_buffered)
    segments: list[dict] = [{"applied": [], "lost": 0}]
    history: dict[int, list[int]] = {}
    pending: list = []
    current = [0]

    def handle(d: Decision) -> None:
        if d.reset:
            segments.append({"applied": [], "lost": 0})
        segments[-1]["applied"].extend(d.apply)
        segments[-1]["lost"] += d.lost
        if d.replay_from is not None:
            # The engine that was asked answers from its own buffer, even if it restarts meanwhile.
            pending[:] = [d.replay_from, delays[len(segments[-1]["applied"]) % len(delays)], current[0]]

    def replay(step: int) -> None:
        start, _, epoch = pending
        pending.clear()
        for seq in history[epoch][-buffer_len:]:
            if seq >= start:
                handle(tracker.replayed(seq, (epoch, seq)))
        handle(tracker.replay_failed() if failures[step] else tracker.replay_done())

    for step, ((epoch, seq), ok) in enumerate(zip(published, delivered, strict=True)):
        history.setdefault(epoch, []).append(seq)
        current[0] = epoch
        if ok:
            handle(tracker.live(seq, (epoch, seq)))
        if pending:
            if pending[1] == 0:
                replay(step)
            else:
                pending[1] -= 1
    if pending:
        replay(len(published) - 1)
    assert not tracker.replaying
    return segments


def detectable_restarts(published, delivered) -> bool:
    """A restart is only visible when the new run's first delivered seq is below the last one seen."""
    last: tuple[int, int] | None = None
    for (epoch, seq), ok in zip(published, delivered, strict=True):
        if not ok:
            continue
        if last is not None and epoch != last[0] and seq >= last[1]:
            return False
        last = (epoch, seq)
    return True


@settings(max_examples=400, deadline=None)
@given(scenario())
def test_applies_each_batch_once_in_order_and_accounts_for_every_missing_one(case):
    published, delivered, delays, failures, buffer_len = case
    assume(detectable_restarts(published, delivered))
    segments = [s for s in run(*case) if s["applied"]]
    epochs_seen = sorted({e for (e, _), ok in zip(published, delivered, strict=True) if ok})
    # Batches held during a replay die with the engine that sent them: a restart can hide an epoch.
    segment_epochs = [s["applied"][0][0] for s in segments]
    assert segment_epochs == sorted(set(segment_epochs))
    assert segment_epochs[-1:] == epochs_seen[-1:]
    for segment in segments:
        items = segment["applied"]
        assert len({e for e, _ in items}) == 1
        seqs = [s for _, s in items]
        assert seqs == sorted(set(seqs))
        assert len(seqs) + segment["lost"] == seqs[-1] + 1


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_with_a_full_replay_buffer_nothing_is_lost(case):
    published, delivered, delays, _, _ = case
    assume(detectable_restarts(published, delivered))
    no_failures = [False] * len(published)
    for segment in run(published, delivered, delays, no_failures, buffer_len=10_000):
        if segment["applied"]:
            assert segment["lost"] == 0
            assert [s for _, s in segment["applied"]] == list(range(len(segment["applied"])))


def test_gap_requests_replay_and_holds_live_batches():
    tracker: SequenceTracker[str] = SequenceTracker()
    assert tracker.live(0, "a").apply == ["a"]
    d = tracker.live(3, "d")
    assert d.replay_from == 1 and d.apply == []
    assert tracker.live(4, "e").apply == []
    assert tracker.replayed(1, "b").apply == ["b"]
    assert tracker.replayed(2, "c").apply == ["c"]
    assert tracker.replayed(3, "d").apply == ["d"]
    done = tracker.replay_done()
    assert done.apply == ["e"] and done.duplicates == 1 and done.lost == 0


def test_restart_resets_and_hold_overflow_gives_up():
    tracker: SequenceTracker[int] = SequenceTracker(max_buffered=2, backfill=False)
    tracker.live(0, 0)
    tracker.live(5, 5)
    assert tracker.live(0, 0).reset
    tracker.live(1, 1)
    assert tracker.live(4, 4).replay_from == 2
    tracker.live(5, 5)
    overflow = tracker.live(6, 6)
    assert overflow.apply == [4, 5, 6] and overflow.lost == 2 and not tracker.replaying


def test_catch_up_replays_from_the_last_applied_seq():
    assert SequenceTracker(backfill=False).catch_up().replay_from is None
    fresh = SequenceTracker()
    assert fresh.catch_up().replay_from == 0
    assert fresh.replayed(0, "z").apply == ["z"] and fresh.replay_done().apply == []
    tracker = SequenceTracker()
    tracker.live(0, "a")
    tracker.live(1, "b")
    decision = tracker.catch_up()
    assert decision.replay_from == 2 and tracker.replaying
    assert tracker.catch_up().replay_from is None
    assert tracker.replayed(2, "c").apply == ["c"]
    held = tracker.live(4, "e")
    assert held.apply == []
    assert tracker.replayed(3, "d").apply == ["d"]
    assert tracker.replay_done().apply == ["e"]
    assert tracker.last_seq == 4 and not tracker.replaying


def test_a_lost_publisher_is_rebuilt_from_scratch():
    """After a disconnect the engine may be a new process whose seq 0 equals our last seq."""
    tracker = SequenceTracker()
    tracker.live(0, "old")
    tracker.publisher_lost()
    decision = tracker.catch_up()
    assert decision.replay_from == 0 and decision.reset
    assert tracker.replayed(0, "new").apply == ["new"]
    assert tracker.replay_done().apply == []
    assert not tracker.catch_up().reset
