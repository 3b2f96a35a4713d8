"""The bodies of the two legs, by vLLM's rules for a router in front of a P/D pair (sans-IO).

Prefill leg: the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` when the client used
it), ``stream=false``, ``n=1``, without ``stream_options`` and ``min_tokens``; its sampled token is thrown
away and the decode engine generates the first token again. With the ``handoff`` protocol it also asks
for ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false}`` and the prefill answer
carries a top-level ``kv_transfer_params`` object that the decode leg carries unchanged. Decode leg: the
client's own body (plus those params). Both legs carry the same ``X-Request-Id``.
"""

from __future__ import annotations

import json
from typing import Any

ASK_HANDOFF = {"do_remote_decode": True, "do_remote_prefill": False}
MAX_PARAMS_BYTES = 64 * 1024
"""A handoff object bigger than this is refused: it names block ids of one prompt (a 32k-token prompt in
16-token blocks is 2,000 ids, ~12 kB) and is copied into a request body."""


def prefill_body(body: dict[str, Any], protocol: str) -> bytes:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "kv_transfer_params")}
    leg.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    if protocol == "handoff":
        leg["kv_transfer_params"] = dict(ASK_HANDOFF)
    return json.dumps(leg).encode()


def handoff_params(answer: bytes) -> dict[str, Any] | None:
    """The prefill answer's ``kv_transfer_params``: None when it has none, or anything but a JSON object of
    bounded size (the answer is untrusted; the decode engine then recomputes the prompt)."""
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(params, dict) or not params or len(json.dumps(params)) > MAX_PARAMS_BYTES:
        return None
    return params


def expires_in(params: dict[str, Any], now_wall: float) -> float | None:
    """Seconds left on the lease by the prefill engine's own ``remote_blocks_expiry_time`` (wall clock),
    when it gives one; vLLM's pull mode leaves it null on the prefill side."""
    at = params.get("remote_blocks_expiry_time")
    if isinstance(at, bool) or not isinstance(at, int | float) or at != at:
        return None
    return float(at) - now_wall


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The client's body, with the handoff when there is one (a stale or missing one: D recomputes)."""
    clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        clean["kv_transfer_params"] = params
    return json.dumps(clean).encode()
