"""Who is to blame when an engine answers a request with an error status (sans-IO).

An engine's error answer is held, not charged at once: if a second engine answers the same request with
the same status and message, the request itself is at fault (vLLM answers 500 to a ``top_k`` beyond 64
bits on every engine). Then the engine's own error goes back to the client, no breaker moves and no
third engine is tried. Otherwise the held answers are charged to their engines once the request is
over. The price: two engines broken in exactly the same way pass their error to the client instead of
a 503, and their breakers do not open on it; their failing /health polls still take them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.openai_errors import ApiError

QUERY_OF_DEATH_LOSSES = 2
"""Engines that may die on one request (the connection lost while it generated) before it is sent to no
other: a request that kills engines (a query of death) would otherwise take a third engine down with it.
The two that died are charged (their health polls tell whether they are back); no third is touched."""
RATE_LIMITED = 429
DEFAULT_RETRY_AFTER_S = 1.0
_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class ErrorAnswer:
    """An engine's error response: status, and what its body and headers said."""

    engine: str
    status: int
    message: str = ""
    param: str | None = None
    retry_after: float | None = None

    @classmethod
    def parse(cls, engine: str, status: int, body: bytes, retry_after: str | None) -> ErrorAnswer:
        """Read vLLM's error shape (``{"error": {"message", "param"}}``) or FastAPI's (``{"detail"}``);
        anything else keeps only the status."""
        message, param = "", None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, dict):
            error = data.get("error")
            if isinstance(error, dict):
                message = error.get("message") if isinstance(error.get("message"), str) else ""
                param = error.get("param") if isinstance(error.get("param"), str) else None
            elif isinstance(data.get("detail"), str):
                message = data["detail"]
        return cls(engine, status, message[:_MESSAGE_CHARS], param, _seconds(retry_after))

    def same_failure(self, other: ErrorAnswer) -> bool:
        return self.status == other.status and self.message == other.message

    def client_error(self) -> ApiError:
        """The engine's own error, as the client gets it when the request is at fault."""
        message = self.message or f"the engine failed on this request with status {self.status}"
        return ApiError(self.status, message, param=self.param)


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 86400 else None


@dataclass
class ErrorLedger:
    """The error answers of one request's attempts, and the verdict on them."""

    answers: list[ErrorAnswer] = field(default_factory=list)

    def add(self, answer: ErrorAnswer) -> ApiError | None:
        """Record an answer; returns the client's error when it repeats an earlier server error (the
        request is at fault: stop trying). A 429 says the engine is busy, never that the request is bad."""
        repeated = answer.status >= 500 and any(answer.same_failure(a) for a in self.answers)
        self.answers.append(answer)
        return answer.client_error() if repeated else None

    def all_rate_limited(self, tried: int) -> ApiError | None:
        """When every engine tried answered 429, the client gets 429 with the longest Retry-After."""
        if tried == 0 or len(self.answers) != tried or any(a.status != RATE_LIMITED for a in self.answers):
            return None
        wait = max((a.retry_after for a in self.answers if a.retry_after is not None), default=DEFAULT_RETRY_AFTER_S)
        return ApiError(RATE_LIMITED, "every engine is over capacity; retry later", code="engines_busy",
                        retry_after=wait)
