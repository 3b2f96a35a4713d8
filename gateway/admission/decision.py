"""The outcome of an admission check, shared by the rate limiter and the priority gate."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai_errors import ApiError


@dataclass(frozen=True, slots=True)
class Admit:
    pass


@dataclass(frozen=True, slots=True)
class Reject:
    """``retry_after_s`` is None when waiting cannot help (the request alone exceeds the limit)."""

    retry_after_s: float | None
    reason: str
    code: str = "rate_limit_exceeded"

    def error(self) -> ApiError:
        """The 429 the router answers, with ``Retry-After`` when waiting helps."""
        return ApiError(429, f"Too many requests: {self.reason}.", code=self.code,
                        retry_after=self.retry_after_s)


ADMIT = Admit()
Decision = Admit | Reject
