"""What an engine does in a disaggregated fleet, and which protocol hands its KV cache over.

``prefill`` engines (vLLM ``kv_role = "kv_producer"``) compute prompts and hand their blocks to ``decode``
engines (``kv_consumer``); ``both`` (``kv_both``, or no connector at all) serve whole requests and may
play either side. A prefill engine and a decode engine form a pair only when they speak the same
protocol: ``handoff`` (the prefill answer carries ``kv_transfer_params`` that the decode leg must carry,
as NixlConnector and MoRIIO) or ``opaque`` (the connector moves the blocks on its own channel, as
ExampleConnector and LMCache; the router only orders the two legs).
"""

from __future__ import annotations

from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
Protocol = Literal["handoff", "opaque"]
PROTOCOLS: tuple[Protocol, ...] = ("handoff", "opaque")


def check_role(key: str, value: Any) -> None:
    """ValueError unless ``value`` is a known role: the one rule for the config, the admin API and peers."""
    if value not in ROLES:
        raise ValueError(f"'{key}' must be one of {', '.join(ROLES)}, got {value!r}"[:200])


def check_protocol(key: str, value: Any) -> None:
    if value not in PROTOCOLS:
        raise ValueError(f"'{key}' must be one of {', '.join(PROTOCOLS)}, got {value!r}"[:200])


def prefills(role: str) -> bool:
    return role in ("prefill", "both")


def decodes(role: str) -> bool:
    return role in ("decode", "both")
