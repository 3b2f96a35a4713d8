"""Sans-IO sequence tracking of one engine's event stream: gaps, replays and restarts.

The caller feeds every live and replayed batch through the tracker and acts on the returned
Decision: apply items in the order given, clear the engine first on a reset, start a replay when
asked. Live batches that arrive while a replay runs are held back so that the index sees batches in
seq order exactly once. When a replay cannot fill a gap (the engine's buffer no longer holds it),
`lost` says so: the engine's state is then partly unknown and the caller lowers its confidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_MAX_BUFFERED = 10_000


@dataclass(slots=True)
class Decision(Generic[T]):
    """What to do after one input: `reset` first (drop the engine's blocks), then apply `apply`."""

    apply: list[T] = field(default_factory=list)
    reset: bool = False
    replay_from: int | None = None
    lost: int = 0
    duplicates: int = 0


class SequenceTracker(Generic[T]):
    """Orders one engine's batches by seq; `T` is whatever the caller wants applied (a decoded batch)."""

    def __init__(self, max_buffered: int = DEFAULT_MAX_BUFFERED, backfill: bool = True) -> None:
        """`backfill`: when the first batch seen (at start or after a restart) is not seq 0, replay
        from 0 to learn the blocks stored before we listened, as far as the engine's buffer reaches."""
        self.last_seq: int | None = None
        self.replaying = False
        self._held: list[tuple[int, T]] = []
        self._max_buffered = max_buffered
        self._backfill = backfill
        self._reset_next = False

    def live(self, seq: int, item: T) -> Decision[T]:
        """A batch from the PUB socket."""
        if self.replaying:
            return self._hold(seq, item)
        last = self.last_seq
        if last is None:
            return self._first(seq, item, reset=False)
        if seq == last + 1:
            self.last_seq = seq
            return Decision(apply=[item])
        if seq < last:
            return self._first(seq, item, reset=True)
        if seq == last:
            return Decision(duplicates=1)
        return self._replay(last + 1, seq, item, reset=False)

    def _first(self, seq: int, item: T, reset: bool) -> Decision[T]:
        if seq == 0 or not self._backfill:
            self.last_seq = seq
            return Decision(apply=[item], reset=reset)
        self.last_seq = -1
        return self._replay(0, seq, item, reset)

    def _replay(self, start: int, seq: int, item: T, reset: bool) -> Decision[T]:
        self.replaying = True
        self._held = [(seq, item)]
        return Decision(replay_from=start, reset=reset)

    def _hold(self, seq: int, item: T) -> Decision[T]:
        newest = self._held[-1][0] if self._held else self.last_seq
        if newest is not None and seq < newest:
            # Lower than what the publisher already sent us: it restarted mid-replay.
            self.replaying = False
            self._held = []
            return self._first(seq, item, reset=True)
        if seq == newest:
            return Decision(duplicates=1)
        self._held.append((seq, item))
        if len(self._held) > self._max_buffered:
            return self.replay_failed()
        return Decision()

    def publisher_lost(self) -> None:
        """The publisher's connection dropped: it may be a new process whose seqs start over at 0 and can
        equal ours (a restart is otherwise only seen as a seq going backwards). Forget the position; the
        next catch-up clears the engine's blocks and rebuilds them from the replay buffer."""
        self.last_seq = None
        self.replaying = False
        self._held = []
        self._reset_next = True

    def catch_up(self) -> Decision[T]:
        """(Re)subscribing: replay whatever was published since the last applied seq (from 0 when none,
        to learn blocks stored before we listened), without waiting for the next live batch to reveal
        the gap: a quiet engine may publish none for a long time."""
        if self.replaying or (self.last_seq is None and not self._backfill):
            return Decision()
        self.replaying = True
        self._held = []
        reset, self._reset_next = self._reset_next, False
        return Decision(replay_from=0 if self.last_seq is None else self.last_seq + 1, reset=reset)

    def replayed(self, seq: int, item: T) -> Decision[T]:
        """A batch from the replay socket (only meaningful while a replay runs)."""
        last = self.last_seq
        if not self.replaying or (last is not None and seq <= last):
            return Decision(duplicates=1)
        lost = 0 if last is None else seq - last - 1
        self.last_seq = seq
        return Decision(apply=[item], lost=lost)

    def replay_done(self) -> Decision[T]:
        """End marker received: release held live batches; any remaining hole is lost."""
        return self._release()

    def replay_failed(self) -> Decision[T]:
        """Replay timed out, errored, or the hold buffer overflowed: give up on the gap."""
        return self._release()

    def _release(self) -> Decision[T]:
        decision: Decision[T] = Decision()
        for seq, item in self._held:
            last = self.last_seq
            if last is not None and seq <= last:
                decision.duplicates += 1
                continue
            if last is not None:
                decision.lost += seq - last - 1
            self.last_seq = seq
            decision.apply.append(item)
        self._held = []
        self.replaying = False
        return decision
