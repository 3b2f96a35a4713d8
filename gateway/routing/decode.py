"""What a request's own decoding will cost on each engine: output tokens x time per token at that batch size.

Time to first token alone is the wrong objective under load. On an engine that admits new requests into
its running batch at once, piling requests onto the engine that holds a hot prefix barely delays their
first token, but every request in that batch then decodes more slowly. Closed-loop clients see that as
throughput collapse: a published cache-aware router fell to 0.44x of round robin exactly this way. So
the cost model adds the decode time the request itself will see, learned per engine as
``time per token = base + per_request * requests in the batch``, and ranks by time to the last token.
At low concurrency every engine's batch is empty, this term is equal everywhere, and cache reuse decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_TPOT_S = 10.0
_MAX_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class DecodePrior:
    """Before-data beliefs (A40-class engine, ~1.5B model) and how fast observations replace them.

    ``weight``: what the fixed prior is worth in observations; ``engine_weight``: what the fleet's fit is
    worth as the prior of one engine. An engine is judged by the fleet's speed until its own streams say
    otherwise: an engine that has served nothing yet (new, or restarted) must not look slower than its
    twins because only they have data, or it would never get the traffic that teaches otherwise.
    """

    base_s: float = 0.010
    per_request_s: float = 0.0005
    output_tokens: float = 128.0
    weight: float = 1.0
    engine_weight: float = 4.0
    decay: float = 0.98
    output_decay: float = 0.95


PSEUDO_DEPTH = 8.0


@dataclass(slots=True)
class _Stats:
    """Exponentially weighted sums for a least-squares line of time per token against batch depth."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.n, self.sx, self.sy = self.n * decay + 1, self.sx * decay + x, self.sy * decay + y
        self.sxx, self.sxy = self.sxx * decay + x * x, self.sxy * decay + x * y

    def plus(self, other: _Stats) -> _Stats:
        return _Stats(self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.sxx + other.sxx,
                      self.sxy + other.sxy)

    @staticmethod
    def line_as_data(base: float, slope: float, weight: float) -> _Stats:
        """``weight`` pseudo-observations split between depth 0 and PSEUDO_DEPTH on a given line."""
        half, y8 = weight / 2, base + slope * PSEUDO_DEPTH
        return _Stats(weight, half * PSEUDO_DEPTH, half * (base + y8), half * PSEUDO_DEPTH ** 2,
                      half * PSEUDO_DEPTH * y8)

    def line(self) -> tuple[float, float]:
        var = self.n * self.sxx - self.sx * self.sx
        slope = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var) if var > 1e-12 else 0.0
        return max(0.0, (self.sy - slope * self.sx) / self.n), slope


@dataclass
class DecodeModel:
    prior: DecodePrior = field(default_factory=DecodePrior)
    _stats: dict[str, _Stats] = field(default_factory=dict)
    _lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    _fleet: tuple[float, float] | None = None
    _output_tokens: float | None = None
    rejected: int = 0

    def _line(self, engine_id: str) -> tuple[float, float]:
        line = self._lines.get(engine_id)
        if line is None:
            p = self.prior
            if self._fleet is None:
                fleet = _Stats.line_as_data(p.base_s, p.per_request_s, p.weight)
                for stats in self._stats.values():
                    fleet = fleet.plus(stats)
                self._fleet = fleet.line()
            own = self._stats.get(engine_id, _Stats())
            line = self._lines[engine_id] = own.plus(_Stats.line_as_data(*self._fleet, p.engine_weight)).line()
        return line

    def time_per_token_s(self, engine_id: str, batch_depth: int) -> float:
        base, slope = self._line(engine_id)
        return base + slope * max(0, batch_depth)

    def expected_output_tokens(self, max_tokens: int | None) -> float:
        """The request's cap when given, else the recent average answer length (or the prior's)."""
        typical = self._output_tokens if self._output_tokens is not None else self.prior.output_tokens
        return float(min(max_tokens, typical)) if max_tokens is not None else typical

    def decode_s(self, engine_id: str, batch_depth: int, max_tokens: int | None) -> float:
        """Time from the first token to the last for a request joining a batch of ``batch_depth``."""
        return max(0.0, self.expected_output_tokens(max_tokens) - 1) * self.time_per_token_s(engine_id, batch_depth)

    def observe(self, engine_id: str, batch_depth: int, output_tokens: int, decode_s: float) -> bool:
        """One finished stream: ``output_tokens`` events in ``decode_s`` after the first. Impossible values
        are counted and dropped."""
        valid = (isinstance(batch_depth, int) and batch_depth >= 0 and isinstance(output_tokens, int)
                 and 1 <= output_tokens <= _MAX_TOKENS and isinstance(decode_s, int | float)
                 and 0.0 <= decode_s <= _MAX_TPOT_S * output_tokens)
        if not valid:
            self.rejected += 1
            return False
        p = self.prior
        self._output_tokens = (output_tokens if self._output_tokens is None
                               else p.output_decay * self._output_tokens + (1 - p.output_decay) * output_tokens)
        if output_tokens >= 2:
            self._stats.setdefault(engine_id, _Stats()).add(float(batch_depth), decode_s / (output_tokens - 1),
                                                            p.decay)
            self._invalidate()
        return True

    def forget(self, engine_id: str) -> None:
        self._stats.pop(engine_id, None)
        self._invalidate()

    def _invalidate(self) -> None:
        """Every line leans on the fleet's, which any observation moves: both are recomputed on next use."""
        self._lines.clear()
        self._fleet = None
