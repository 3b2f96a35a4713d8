"""Homes: which engines each shared prefix lives on, kept stable so the fleet's caches partition (sans-IO).

Under KV pressure the cost model alone treats every placement as a one-off: a request that leaves a busy
holder for a cold engine evicts whatever that engine held, the next request of the evicted prefix does
the same elsewhere, and the fleet thrashes. The home book remembers, per prefix (the request's leading
blocks, ``RouteRequest.home_key``), the engines it was sent to and how hot it is there: a count of its
requests that fades by ``decay`` per request the router places (no clock, so decisions replay).

Prefixes homed on an engine claim its cache in order of heat; what fits ``fill`` of the engine's blocks
stays homed, the coldest beyond it lose their home there (never the prefix just sent there). Sending a
request to an engine that is not its home is charged the recompute of the homed prefixes its blocks would
push out (``displacement_s``), weighted by their heat against the newcomer's: a cold prefix never evicts a
hot one for free, and a hot prefix gets a second home only when its home's queue costs more than a
prefill elsewhere plus that displacement. A prefix without a home is also charged the queueing it will
meet beside the heat already homed on each engine (``crowding``), so new prefixes spread over the engines
in proportion to load rather than piling onto whichever engine has empty blocks. Homes nobody reads fade
away, so a prefix holds as many homes as its load keeps warm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

HOME_BLOCKS = 4
"""Leading blocks that name a prefix's home: enough to tell system prompts and documents apart."""


@dataclass(frozen=True, slots=True)
class HomeSettings:
    decay: float = 0.5 ** (1 / 16)
    """Heat kept per placed request: a prefix's heat halves over 16 requests to the fleet, so a prefix that
    stopped being asked yields its homes to new ones within a few dozen requests."""
    min_heat: float = 0.25
    """A home colder than this is forgotten (a spill home that is no longer used, a prefix gone quiet)."""
    fill: float = 0.85
    """Share of an engine's blocks homes may claim; the rest is for the requests running there."""
    max_prefixes: int = 4096
    silence_slack: float = 0.5
    young_requests: int = 16
    """A prefix younger than this many placed requests has its heat scaled as if this old."""
    sweep_every: int = 16
    """Records between two sweeps of faded homes. A decision reads every engine's residents, so homes left
    listed after they faded cost every decision: with one-off prompts (a new prefix per request) the listings
    grew to ``max_prefixes`` and each decision re-read all of them."""


@dataclass(slots=True)
class _Prefix:
    blocks: int
    heat: dict[str, float] = field(default_factory=dict)
    """Engine -> heat, as of ``stamp``."""
    stamp: int = 0
    born: int = 0


@dataclass(frozen=True, slots=True)
class Resident:
    key: str
    blocks: int
    heat: float


class HomeBook:
    """Homes and heats of prefixes; ``record`` is called once per placed request, reads are pure."""

    def __init__(self, settings: HomeSettings | None = None) -> None:
        self.settings = settings or HomeSettings()
        self._prefixes: dict[str, _Prefix] = {}
        self._residents: dict[str, dict[str, None]] = {}
        self._capacity: dict[str, int] = {}
        self._memo: dict[str, list[Resident]] = {}
        self._key_memo: dict[str, tuple[list[str], float]] = {}
        self._clock = 0

    def _heat(self, prefix: _Prefix, engine: str) -> float:
        """Decayed count of the prefix's requests to ``engine``, as the steady count of its request rate.

        A young prefix's count is scaled up to what a full window at the same rate would hold (a bias-corrected
        moving average), so a prefix that just arrived is not mistaken for a cold one; and a prefix silent for
        ``s`` requests is credited at most ``silence_slack`` requests per ``s``, so one that stopped being asked
        cools within a few of its former gaps instead of over the decay's whole half-life."""
        decay = self.settings.decay
        window = 1.0 - decay ** max(self._clock - prefix.born, self.settings.young_requests)
        silence = self._clock - prefix.stamp
        heat = prefix.heat.get(engine, 0.0) * decay ** silence / window
        return min(heat, self.settings.silence_slack / max(1, silence) / (1.0 - decay)) if silence else heat

    def _key_reads(self, key: str) -> tuple[list[str], float]:
        """``key``'s homes and heat, computed once between two records (a decision reads them per engine)."""
        found = self._key_memo.get(key)
        if found is None:
            prefix = self._prefixes.get(key)
            if prefix is None:
                found = [], 0.0
            else:
                warm = [(self._heat(prefix, e), e) for e in prefix.heat]
                homes = [e for h, e in sorted(warm, key=lambda he: (-he[0], he[1])) if h >= self.settings.min_heat]
                found = homes, sum(h for h, _ in warm)
            self._key_memo[key] = found
        return found

    def homes(self, key: str) -> list[str]:
        """The engines ``key`` is homed on, hottest first (ties by engine id)."""
        return list(self._key_reads(key)[0])

    def heat(self, key: str) -> float:
        """Requests of ``key`` recently placed anywhere (decayed)."""
        return self._key_reads(key)[1]

    def residents(self, engine: str, exclude: str = "") -> list[Resident]:
        """Prefixes homed on ``engine``, hottest first (computed once between two records: a decision reads
        every engine's residents several times)."""
        found = self._listed(engine)
        return [r for r in found if r.key != exclude] if exclude else list(found)

    def _listed(self, engine: str) -> list[Resident]:
        """``residents`` of ``engine`` as memoised: read, never changed, by the callers (no copy per read)."""
        found = self._memo.get(engine)
        if found is None:
            found = []
            for key in self._residents.get(engine, {}):
                prefix = self._prefixes[key]
                heat = self._heat(prefix, engine)
                if heat >= self.settings.min_heat:
                    found.append(Resident(key, prefix.blocks, heat))
            found.sort(key=lambda r: (-r.heat, r.key))
            self._memo[engine] = found
        return found

    def resident_heat(self, engine: str, exclude: str = "") -> float:
        """How much recent traffic the prefixes homed on ``engine`` bring it."""
        return sum(r.heat for r in self._listed(engine) if r.key != exclude)

    def displaced(self, key: str, blocks: int, engine: str,
                  capacity_blocks: int | None) -> list[tuple[Resident, float]]:
        """Homed prefixes that placing ``blocks`` of ``key`` on ``engine`` pushes out of its ``fill``, coldest
        first, each with the share of its recompute charged: its heat against its own plus the newcomer's
        (and one request), so hot residents cost nearly a full recompute, a newcomer twice as hot displaces a
        resident at a third of one, and a cold resident costs little. Empty when ``key`` is homed there, or
        the engine's size is unknown."""
        if not key or not capacity_blocks or engine in self._key_reads(key)[0]:
            return []
        room = self.settings.fill * capacity_blocks
        residents = [r for r in self._listed(engine) if r.key != key]
        used = sum(r.blocks for r in residents) + blocks
        if used <= room:  # nothing is pushed out: the common case, without the heat lookup below
            return []
        mine = self.heat(key)
        out = []
        for r in reversed(residents):
            if used <= room:
                break
            used -= r.blocks
            out.append((r, r.heat / (r.heat + mine + 1.0)))
        return out

    def displacement_s(self, key: str, blocks: int, engine: str, capacity_blocks: int | None,
                       recompute_s: Callable[[int], float]) -> float:
        """Expected recompute of the displaced homes (``recompute_s`` of a block count)."""
        return sum(share * recompute_s(r.blocks) for r, share in self.displaced(key, blocks, engine, capacity_blocks))

    def record(self, key: str, engine: str, blocks: int, capacity_blocks: int | None) -> None:
        """One request of ``key`` (``blocks`` long) was sent to ``engine``: heat it there, and drop the homes
        that no longer fit the engine's ``fill`` (coldest first, possibly this one)."""
        if not key:
            return
        self._clock += 1
        self._forget_reads()
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = _Prefix(blocks, born=self._clock - 1)
            self._prune()
        faded = [e for e in prefix.heat if e != engine and self._heat(prefix, e) < self.settings.min_heat]
        for e in faded:
            self._unhome(key, prefix, e)
        for e in prefix.heat:
            prefix.heat[e] *= self.settings.decay ** (self._clock - prefix.stamp)
        prefix.stamp = self._clock
        prefix.blocks = max(1, blocks)
        prefix.heat[engine] = prefix.heat.get(engine, 0.0) + 1.0
        self._prefixes[key] = prefix
        self._residents.setdefault(engine, {})[key] = None
        if capacity_blocks:
            self._capacity[engine] = capacity_blocks
        for home in list(prefix.heat):
            self._fit(home, keep=key if home == engine else "")
        if self._clock % self.settings.sweep_every == 0:
            self._sweep_faded()
        self._forget_reads()  # reads made while the book changed (``_prune``'s, ``_fit``'s) are stale

    def _sweep_faded(self) -> None:
        """Unhome every home that faded below ``min_heat``: what the prefix's next record (or its engine's next
        ``_fit``) would do, done before the listings grow with prefixes that may never come back. A faded
        home's heat only falls until its prefix is recorded again, and that record unhomes it first."""
        for engine in list(self._residents):
            for faded in self._faded(engine):
                self._unhome(faded.key, self._prefixes[faded.key], engine)

    def _fit(self, engine: str, keep: str = "") -> None:
        """Unhome the coldest prefixes of ``engine`` until its homes fit ``fill`` of its blocks; ``keep``, the
        prefix just sent there, stays: the engine's LRU keeps what it served last, and the cost of pushing a
        hotter prefix out was weighed when it was placed."""
        capacity = self._capacity.get(engine)
        listed = self._residents.get(engine, {})
        if not capacity or sum(self._prefixes[k].blocks for k in listed) <= self.settings.fill * capacity:
            return
        residents = self.residents(engine) + self._faded(engine)
        used = sum(r.blocks for r in residents)
        for r in sorted(residents, key=lambda r: (r.key != keep, r.heat, r.key)):
            if used <= self.settings.fill * capacity:
                break
            if r.key == keep:
                continue
            used -= r.blocks
            self._unhome(r.key, self._prefixes[r.key], engine)

    def _faded(self, engine: str) -> list[Resident]:
        """Residents listed on ``engine`` whose home there has faded below ``min_heat``."""
        out = []
        for key in self._residents.get(engine, {}):
            prefix = self._prefixes[key]
            heat = self._heat(prefix, engine)
            if heat < self.settings.min_heat:
                out.append(Resident(key, prefix.blocks, heat))
        return out

    def _unhome(self, key: str, prefix: _Prefix, engine: str) -> None:
        self._forget_reads()
        prefix.heat.pop(engine, None)
        self._residents.get(engine, {}).pop(key, None)
        if not prefix.heat:
            self._prefixes.pop(key, None)

    def _forget_reads(self) -> None:
        self._memo.clear()
        self._key_memo.clear()

    def _prune(self) -> None:
        """Keep the book bounded: past ``max_prefixes``, the coldest quarter goes."""
        if len(self._prefixes) <= self.settings.max_prefixes:
            return
        ranked = sorted(self._prefixes, key=lambda k: (self.heat(k), k))
        for key in ranked[: len(ranked) // 4]:
            prefix = self._prefixes[key]
            for engine in list(prefix.heat):
                self._unhome(key, prefix, engine)

    def forget_engine(self, engine: str) -> None:
        """An engine left or restarted empty: nothing is homed on it any more."""
        self._capacity.pop(engine, None)
        self._forget_reads()
        for key in list(self._residents.pop(engine, {})):
            prefix = self._prefixes.get(key)
            if prefix is not None:
                prefix.heat.pop(engine, None)
                if not prefix.heat:
                    self._prefixes.pop(key, None)
