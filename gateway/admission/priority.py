"""Priority tiers and load shedding in front of the engines (sans-IO).

Queue depth of an engine = the router's own in-flight requests to it + the engine's
``vllm:num_requests_waiting`` from the last metrics poll: the first reacts instantly, the second sees
what other replicas sent. An engine "has room" for a tier when its depth is below the tier's limit:
``threshold`` for normal, ``threshold / 2`` for low (so low traffic is shed first), none for high.
A request is rejected only when no candidate has room, since the router can still pick that one.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.admission.decision import ADMIT, Decision, Reject
from gateway.openai_errors import ApiError
from gateway.security.auth import Tenant
from gateway.security.config import PRIORITIES

PRIORITY_HEADER = "x-priority"


def resolve_priority(tenant: Tenant, header: str | None) -> str:
    """The tenant's class, or the ``x-priority`` header's when the tenant may choose (400 if malformed).

    A tenant that may not choose has the header ignored rather than refused: clients send it blindly.
    """
    if header is None or not tenant.allow_priority_header:
        return tenant.priority
    value = header.strip().lower()
    if value not in PRIORITIES:
        raise ApiError(400, f"x-priority must be one of {', '.join(PRIORITIES)}", param=PRIORITY_HEADER)
    return value


def queue_limit(priority: str, threshold: int) -> float:
    """Depth from which an engine is full for this tier (infinite for high)."""
    if priority == "high":
        return float("inf")
    return threshold / 2 if priority == "low" else float(threshold)


def admit(
    priority: str, engine_queue_depths: Sequence[int], threshold: int, retry_after_s: float = 1.0
) -> Decision:
    """Admit if any candidate engine has room for this tier; no candidates is not this gate's call."""
    limit = queue_limit(priority, threshold)
    if not engine_queue_depths or min(engine_queue_depths) < limit:
        return ADMIT
    return Reject(retry_after_s, f"every engine is over its queue limit for {priority} priority",
                  code="overloaded")
