"""What an ingest process tells the serving process, in order: index changes, freshness and counters.

A replica can ingest KV events in a process of its own (gateway/ingest_worker.py): it decodes, orders, replays
and derives own keys there, against a ``KeyLedger`` (index/key_ledger.py), and the serving process only applies
the ledger's store calls to its full index. Everything that would have touched the serving side's state is a
note, kept in the order it happened, so the serving index, each engine's freshness and the event counters end
as they would have with ingest on the serving loop.

Wire form (one message per worker tick): frame 0 is a msgpack list of notes, each a list whose first item names
it; the block hashes and own keys the notes carry follow in frame 1, one little-endian u64 array holding every
note's words in note order (a message of no such note has no frame 1):

    ["s", holder, n]                          store_many: the next n words are the hashes, then n own keys
    ["r", holder, n]                          remove: the next n words are the hashes
    ["c", holder]                             clear
    ["i", engine, n, cleared]                 CacheView.on_ingest (the next n words are the stored own keys,
                                              n may be 0; AllBlocksCleared count)
    ["z", engine]                             CacheView.on_reset
    ["e", engine, holder, seq]                the holder's batch ``seq`` is applied (freshness.on_events)
    ["g", engine] / ["l", engine, batches] / ["x", engine] / ["p", engine]
                                              a gap / lost batches / a stream reset / a failed replay
    ["n", counter, [label values], amount]    an event counter went up
    ["t", step, seconds]                      the ingest process's time in an ingest step (index/ingest_times.py)

One array for the whole message, not one frame per note: a tick of 16-64 engines carries a few notes per engine
batch, and the serving side paid a frame, a range check and an array per note (a third of what applying the
notes cost it, by a py-spy profile of a replica at 150k block ops/s).

The serving side checks every note (its own child is still outside the process): a message that does not
decode is refused whole, and notes about engines it does not ingest are skipped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
from prometheus_client import Counter

from events.counters import BLOCK_OPS, EVENT_BATCHES, EVENTS_DROPPED, INGEST_DEFERRED, REPLAYS, SUBSCRIBER_RESTARTS
from index.freshness import EngineFreshness
from index.ingest import IngestStats
from index.ingest_times import INGEST_PROCESS_TIMES, INGEST_TIMES, STEPS, IngestTimes
from index.mask_table import KEY_LIMIT
from index.tiers import source_of
from index.view import CacheView

FORWARDED_COUNTERS: dict[str, Counter] = {
    counter._name: counter  # noqa: SLF001 - the counter's own name is its identity on the wire
    for counter in (EVENTS_DROPPED, BLOCK_OPS, REPLAYS, SUBSCRIBER_RESTARTS, INGEST_DEFERRED)
}
"""The event path's counters an ingest process counts and the serving process exports, their growth sent once a
second. Applied batches (``kvmesh_event_batches_total``) are counted here as their notes are applied instead: they
say how far this side's index has got."""
MAX_MESSAGE_WORDS = 1 << 23
"""Words one message may carry: more than any split message (``split_notes``) holds, whose one note past the line
is at most an engine step (a full prompt re-announced is ~8k blocks)."""


class NotesError(ValueError):
    """A worker message that is not a well-formed list of notes."""


def encode_notes(notes: Iterable[tuple[Any, ...]]) -> list[bytes]:
    """Frames of one message: the notes' list, then (if any note carries blocks) every word they carry."""
    words: list[int] = []
    header: list[list[Any]] = []
    for note in notes:
        kind = note[0]
        if kind == "s":
            words += note[2]
            words += note[3]
            header.append(["s", note[1], len(note[2])])
        elif kind in ("r", "i"):
            words += note[2]
            header.append([kind, note[1], len(note[2]), *note[3:]])
        else:
            header.append(list(note))
    frames = [msgpack.packb(header, use_bin_type=True)]
    if words:
        frames.append(np.array(words, dtype="<u8").tobytes())
    return frames


def split_notes(notes: Sequence[tuple[Any, ...]], ops: int) -> Iterable[list[tuple[Any, ...]]]:
    """The notes in order, cut into parts of about ``ops`` block ops (hashes and keys carried) each."""
    part: list[tuple[Any, ...]] = []
    carried = 0
    for note in notes:
        part.append(note)
        if note[0] in ("s", "r", "i"):
            carried += len(note[2])
            if carried >= ops:
                yield part
                part, carried = [], 0
    if part:
        yield part


_NO_WORDS = np.zeros(0, dtype=np.uint64)
_NO_WORDS.flags.writeable = False


class Note(NamedTuple):
    """One decoded note (a tuple: a message's notes are built by the thousand a second on the serving loop)."""

    kind: str
    name: str
    """The holder (s, r, c), the engine (i, z, e, g, l, x, p), the counter (n) or the ingest step (t)."""
    hashes: np.ndarray = _NO_WORDS
    """u64, read-only (a view of the message's array frame): the index's compiled loops read it as it is."""
    keys: np.ndarray = _NO_WORDS
    holder: str = ""
    number: float = 0
    labels: tuple[str, ...] = ()


def _words(frames: Sequence[bytes]) -> np.ndarray:
    """The message's carried words, range-checked once (a view of the frame: the index's loops read it as it is)."""
    if len(frames) == 1:
        return _NO_WORDS
    if len(frames) != 2:
        raise NotesError("a message is a list of notes and at most one array frame")
    raw = frames[1]
    if not raw or len(raw) % 8 or len(raw) // 8 > MAX_MESSAGE_WORDS:
        raise NotesError("the array frame is not a bounded run of u64 words")
    values = np.frombuffer(raw, dtype="<u8")
    if int(values.max()) >= KEY_LIMIT:
        raise NotesError("a hash or own key out of the index's range")
    return values


class _Reader:
    """The carried words, handed out to the notes in order."""

    __slots__ = ("words", "at")

    def __init__(self, words: np.ndarray) -> None:
        self.words, self.at = words, 0

    def take(self, count: Any) -> np.ndarray:
        if type(count) is not int or not 0 <= count <= len(self.words) - self.at:
            raise NotesError("a note carries more words than the message has")
        self.at += count
        return self.words[self.at - count : self.at]


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise NotesError("a note's name is not a short string")
    return value


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        raise NotesError("a note's count is not a non-negative int")
    return value


def decode_notes(frames: Sequence[bytes]) -> list[Note]:
    """The notes of one message, every field checked; raises NotesError for anything else."""
    if not frames:
        raise NotesError("an empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise NotesError(f"notes do not decode: {type(exc).__name__}") from None
    if not isinstance(header, list):
        raise NotesError("notes are not a list")
    words = _Reader(_words(frames))
    notes = [_note(item, words) for item in header]
    if words.at != len(words.words):
        raise NotesError("the array frame carries words no note names")
    return notes


_ARITY = {"s": 2, "r": 2, "c": 1, "i": 3, "z": 1, "e": 3, "g": 1, "l": 2, "x": 1, "p": 1, "n": 3, "t": 2}


def _note(item: Any, words: _Reader) -> Note:
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise NotesError("a note is not a list led by its kind")
    kind, args = item[0], item[1:]
    arity = _ARITY.get(kind)
    if arity is None or len(args) != arity:
        raise NotesError(f"an unknown note or one of the wrong size: {kind!r}")
    name = _text(args[0])
    if kind == "s":
        hashes = words.take(args[1])
        return Note(kind, name, hashes, words.take(args[1]))
    if kind == "r":
        return Note(kind, name, words.take(args[1]))
    if kind == "i":
        return Note(kind, name, keys=words.take(args[1]), number=_count(args[2]))
    if kind == "e":
        return Note(kind, name, holder=_text(args[1]), number=_count(args[2]))
    if kind == "l":
        return Note(kind, name, number=_count(args[1]))
    if kind == "n":
        labels, amount = args[1], args[2]
        if name not in FORWARDED_COUNTERS or not isinstance(labels, list) or not all(
                isinstance(label, str) and len(label) <= 1024 for label in labels):
            raise NotesError("a counter note names no forwarded counter or has bad labels")
        return Note(kind, name, labels=tuple(labels), number=_amount(amount, "a counter note's amount"))
    if kind == "t":
        if name not in STEPS:
            raise NotesError("a time note names no ingest step")
        return Note(kind, name, number=_amount(args[1], "a time note's seconds"))
    return Note(kind, name)


def _amount(value: Any, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise NotesError(f"{what} is not a finite non-negative number")
    return value


class NotedFreshness(EngineFreshness):
    """One event source's freshness in the ingest process: what the serving side's copy must hear is noted."""

    def __init__(self, engine: str, holder: str, notes: list[tuple[Any, ...]]) -> None:
        super().__init__(has_events=True)
        self.engine, self.holder, self.notes = engine, holder, notes

    def on_events(self, now: float, seq: int) -> None:
        super().on_events(now, seq)
        self.notes.append(("e", self.engine, self.holder, seq))

    def on_gap(self) -> None:
        super().on_gap()
        self.notes.append(("g", self.engine))

    def on_lost(self, now: float, batches: int) -> None:
        super().on_lost(now, batches)
        self.notes.append(("l", self.engine, batches))

    def on_replay_failed(self) -> None:
        super().on_replay_failed()
        self.notes.append(("p", self.engine))

    def on_reset(self) -> None:
        super().on_reset()
        self.notes.append(("x", self.engine))


class NotedView(CacheView):
    """The ingest process's view: the serving side's speculative entries hear what ingest told this one."""

    def __init__(self, store: Any, notes: list[tuple[Any, ...]]) -> None:
        super().__init__(store)
        self.notes = notes

    def on_ingest(self, engine: str, stats: IngestStats) -> None:
        if stats.stored_keys or stats.cleared:
            self.notes.append(("i", engine, stats.stored_keys, stats.cleared))

    def on_reset(self, engine: str) -> None:
        self.notes.append(("z", engine))


class CounterDeltas:
    """The forwarded counters' growth since the last call, as notes (the ingest process's registry is its own)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}

    def notes(self) -> list[tuple[Any, ...]]:
        found: list[tuple[Any, ...]] = []
        for name, counter in FORWARDED_COUNTERS.items():
            for metric in counter.collect():
                for sample in metric.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    labels = tuple(sample.labels[label] for label in counter._labelnames)  # noqa: SLF001
                    key = (name, labels)
                    delta = sample.value - self._seen.get(key, 0.0)
                    if delta > 0:
                        self._seen[key] = sample.value
                        found.append(("n", name, list(labels), int(delta) if delta == int(delta) else delta))
        return found


class TimeDeltas:
    """The growth of this process's ingest times by step since the last call, as notes: the serving process
    exports them as its ingest process's (``INGEST_PROCESS_TIMES``)."""

    def __init__(self, times: IngestTimes = INGEST_TIMES) -> None:
        self._times = times
        self._seen = dict.fromkeys(STEPS, 0.0)

    def notes(self) -> list[tuple[Any, ...]]:
        found: list[tuple[Any, ...]] = []
        for step, seconds in self._times.steps().items():
            if seconds > self._seen[step]:
                found.append(("t", step, seconds - self._seen[step]))
                self._seen[step] = seconds
        return found


def apply_notes(notes: Sequence[Note], view: CacheView, sources: Callable[[str], bool],
                applied: dict[str, int], now: float) -> set[str]:
    """Apply a worker message's notes to the serving side in order; returns the engines they touched.

    ``sources(holder)``: whether that event source (a GPU holder; its tiers follow it) is ingested now: notes
    of an engine removed meanwhile would put back blocks it no longer has. ``applied``: each source's last
    applied seq, kept here."""
    store = view.store
    touched: set[str] = set()
    for note in notes:
        kind = note.kind
        if kind in ("s", "r", "c"):
            if not sources(source_of(note.name)):
                continue
            if kind == "s":
                store.store_many(note.name, note.hashes, note.keys)
            elif kind == "r":
                store.remove(note.name, note.hashes)
            else:
                store.clear(note.name)
            continue
        if kind == "n":
            with contextlib.suppress(ValueError):  # the wrong number of labels for that counter
                FORWARDED_COUNTERS[note.name].labels(*note.labels).inc(note.number)
            continue
        if kind == "t":
            INGEST_PROCESS_TIMES.add_steps({note.name: note.number})
            continue
        info = view.info(note.name)
        if info is None:
            continue
        touched.add(note.name)
        if kind == "e":
            if sources(note.holder):
                applied[note.holder] = int(note.number)
                info.freshness.on_events(now, int(note.number))
                EVENT_BATCHES.labels(engine=note.name).inc()
        elif kind == "i":
            view.on_ingest(note.name, IngestStats(cleared=int(note.number), stored_keys=note.keys.tolist()))
        elif kind == "z":
            view.on_reset(note.name)
        elif kind == "g":
            info.freshness.on_gap()
        elif kind == "l":
            info.freshness.on_lost(now, int(note.number))
        elif kind == "x":
            info.freshness.on_reset()
        elif kind == "p":
            info.freshness.on_replay_failed()
    return touched
