"""Conversations per engine: how many blocks their growing histories keep there, and when they stop fitting (sans-IO).

A multi-turn conversation or an agent's session re-reads its whole history every turn and adds a turn to it.
Each session of one system prompt follows the cache to that prompt's home, and the home book
(gateway/routing/homes.py) counts the prompt's blocks once, not the histories growing beside it: six sessions
of two prompts on one engine of two (seed 2 suite shape #13, 768 blocks per engine) kept their histories for
three turns, then outgrew the cache together, and the engine's LRU evicted each history before its next turn
(hit 0.63 of the prompt tokens against 0.80 for smg, which had placed the sessions apart). The cost model sees
each turn alone: a turn's hit at home always beats a full prefill elsewhere.

So the book keeps, per engine, the sessions seen there more than once (a request's ``prefix_key``: its system
prompt and first user turn) and each one's private blocks: its latest prompt less what the engine already held
when the session arrived (the shared system prompt, for all but the session that brought it). Their sum is what
the engine must keep for its conversations. A session's next turn placed where that sum, with this turn's new
blocks, passes ``fill`` of the engine's blocks is charged the recompute of its whole prompt (``overflow_s``,
scaled down while the excess is smaller than the session's own blocks): under LRU with every session coming back
in turn, a cache smaller than the sessions' histories keeps none of them until their next turn. The first engine
to overflow then sheds sessions to engines with room, one at a time, each move taking its history out of the sum,
until the rest fit. A request seen once is not counted: single questions leave tails the engine evicts first,
and nothing changes for traffic without conversations.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SessionSettings:
    fill: float = 0.85
    """Share of an engine's blocks the histories may claim; the rest is for the requests running there."""
    forget_after: int = 32
    """A session not placed on its engine for this many of that engine's placements is forgotten."""
    late_turns: float = 2.0
    """A returning session silent for this many of its own gaps between turns (counted in the engine's
    placements) plus ``late_slack`` no longer counts: its conversation ended, and LRU drops its blocks first. With
    the fixed ``forget_after`` alone, thirteen conversations starting and ending on five engines (seed 2 #20) were
    counted with as many ended ones beside them and moved for room they had."""
    late_slack: int = 2
    max_sessions: int = 65_536


@dataclass(slots=True)
class _Session:
    shared: int
    """Blocks the engine held of the session's prompt when it arrived there (not its own)."""
    size: int
    """Its latest prompt's blocks."""
    seen: int
    """The engine's placement count when the session was last placed there."""
    turns: int = 0
    due: int = 0
    """The engine's placement count past which the session is forgotten."""

    @property
    def private(self) -> int:
        return self.size - self.shared if self.size > self.shared else 0


@dataclass(slots=True)
class _Engine:
    sessions: dict[str, _Session] = field(default_factory=dict)
    """In order of their last placement here (oldest first)."""
    deadlines: list[tuple[int, str]] = field(default_factory=list)
    """A heap of (due, session); an entry whose session's ``due`` has moved since is stale."""
    placed: int = 0
    kept: int = 0
    """Private blocks of the sessions seen more than once."""


class SessionBook:
    """``record`` once per placed request; ``overflow_s`` is pure."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.settings = settings or SessionSettings()
        self._engines: dict[str, _Engine] = {}
        self._where: dict[str, str] = {}

    def continues(self, session: str) -> bool:
        """Whether ``session`` was placed before (its request is a later turn)."""
        return bool(session) and session in self._where

    def kept_blocks(self, engine: str) -> int:
        """Private blocks of the returning sessions on ``engine``."""
        found = self._engines.get(engine)
        return found.kept if found else 0

    def record(self, session: str, engine: str, blocks: int, shared_blocks: int) -> None:
        """``session``'s request of ``blocks`` blocks was placed on ``engine``, which held ``shared_blocks`` of it."""
        if not session:
            return
        book = self._engines.setdefault(engine, _Engine())
        book.placed += 1
        before = self._where.get(session)
        if before is not None and before != engine:
            self._drop(session, before)
        state = book.sessions.pop(session, None)
        if state is None:
            state = _Session(shared=min(max(0, shared_blocks), max(0, blocks)), size=max(0, blocks), seen=book.placed)
            state.due = book.placed + self.settings.forget_after
        else:
            if state.turns:
                book.kept -= state.private
            gap = book.placed - state.seen
            state.size, state.seen, state.turns = max(0, blocks), book.placed, state.turns + 1
            book.kept += state.private
            state.due = book.placed + min(self.settings.forget_after,
                                          int(self.settings.late_turns * gap) + self.settings.late_slack)
        book.sessions[session] = state
        heapq.heappush(book.deadlines, (state.due, session))
        self._where[session] = engine
        self._expire(engine, book)
        if len(self._where) > self.settings.max_sessions:  # the longest-silent session of the fullest engine
            fullest = max(self._engines, key=lambda e: (len(self._engines[e].sessions), e))
            self._drop(next(iter(self._engines[fullest].sessions)), fullest)

    def overflow_s(self, session: str, engine: str, blocks: int, new_blocks: int, capacity_blocks: int | None,
                   recompute_s: Callable[[int], float]) -> float:
        """Recompute charged for placing ``session``'s next request (``blocks`` long, ``new_blocks`` of them not
        held by ``engine``) on ``engine``, where the engine's returning sessions would then outgrow ``fill`` of its
        blocks: its whole prompt's, times the excess over what the session itself keeps there (capped at all of
        it). An excess of a few blocks, within what the fill's margin guesses for the requests running there, costs
        little: charged in full, it moved a session off an engine whose sessions still fitted (seed 0 #1, seven
        sessions of one prompt on 401 blocks, all hitting at the turn it moved). Nothing for a session never seen
        (its first request) or an engine of unknown size."""
        here = self._where.get(session) if session else None
        if here is None or not capacity_blocks:
            return 0.0
        book = self._engines.get(engine)
        kept, own = (book.kept if book else 0), max(0, new_blocks)
        if here == engine and book is not None:
            state = book.sessions[session]
            kept += 0 if state.turns else state.private
            own += state.private
        excess = kept + max(0, new_blocks) - self.settings.fill * capacity_blocks
        if excess <= 0:
            return 0.0
        return recompute_s(blocks) * (min(1.0, excess / own) if own > 0 else 1.0)

    def _drop(self, session: str, engine: str) -> None:
        book = self._engines[engine]
        state = book.sessions.pop(session)
        if state.turns:
            book.kept -= state.private
        if self._where.get(session) == engine:
            del self._where[session]
        if not book.sessions:
            del self._engines[engine]

    def _expire(self, engine: str, book: _Engine) -> None:
        while book.deadlines and book.deadlines[0][0] < book.placed:
            due, session = heapq.heappop(book.deadlines)
            state = book.sessions.get(session)
            if state is not None and state.due == due:
                self._drop(session, engine)
                if engine not in self._engines:
                    return

    def forget_engine(self, engine: str) -> None:
        """An engine left or restarted empty: none of its sessions' histories are there any more."""
        book = self._engines.pop(engine, None)
        for session in book.sessions if book else ():
            if self._where.get(session) == engine:
                del self._where[session]
