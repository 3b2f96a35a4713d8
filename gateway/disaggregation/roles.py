"""What an engine does in a disaggregated fleet, and which protocol hands its KV cache over.

``prefill`` engines (vLLM ``kv_role = "kv_producer"``) compute prompts and hand their blocks to ``decode``
engines (``kv_consumer``); ``both`` (``kv_both``, or no connector at all) serve whole requests and may
play either side. A prefill engine and a decode engine form a pair only when they speak the same
protocol: ``handoff`` (the prefill answer carries ``kv_transfer_params`` that the decode leg must carry,
as NixlConnector and MoRIIO) or ``opaque`` (the connector moves the blocks on its own channel, as
ExampleConnector and LMCache; the router only orders the two legs).
"""

from __future__ import annotations

import json
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
Protocol = Literal["handoff", "opaque"]
PROTOCOLS: tuple[Protocol, ...] = ("handoff", "opaque")


def check_role(key: str, value: Any) -> None:
    """ValueError unless ``value`` is a known role: the one rule for the config, the admin API and peers."""
    if value is not None and value not in ROLES:
        raise ValueError(f"'{key}' must be one of {', '.join(ROLES)}, got {value!r}"[:200])


def check_protocol(key: str, value: Any) -> None:
    if value is not None and value not in PROTOCOLS:
        raise ValueError(f"'{key}' must be one of {', '.join(PROTOCOLS)}, got {value!r}"[:200])


def prefills(role: str) -> bool:
    return role in ("prefill", "both")


def decodes(role: str) -> bool:
    return role in ("decode", "both")


KV_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
CONNECTOR_PROTOCOLS: dict[str, Protocol] = {
    "NixlConnector": "handoff", "NixlPullConnector": "handoff", "NixlPushConnector": "handoff",
    "MoRIIOConnector": "handoff", "ExampleConnector": "opaque", "SharedStorageConnector": "opaque",
    "LMCacheConnectorV1": "opaque", "LMCacheMPConnector": "opaque"}
"""The connectors whose side of a P/D pair kvmesh knows (vLLM 0.32's registered names); any other leaves
the protocol as configured."""
SERVER_INFO_PATH = "/server_info?config_format=json"
"""vLLM's only endpoint naming the engine's kv_transfer_config (``kv_role``, ``kv_connector``): a
development endpoint, served only with ``VLLM_SERVER_DEV_MODE=1`` (vllm/entrypoints/serve/dev/server_info/
api_router.py ``show_server_info``); a production engine answers 404 there and its role is configured."""


def parse_server_info(body: bytes) -> tuple[Role, Protocol | None]:
    """(role, protocol or None when the connector is unknown) from a ``/server_info`` answer; ValueError when
    it is not one (the engine's answer is untrusted)."""
    try:
        info = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("server_info is not JSON") from None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        raise ValueError("server_info has no vllm_config object")
    transfer = config.get("kv_transfer_config")
    if transfer is None or (isinstance(transfer, dict) and transfer.get("kv_connector") is None):
        return "both", None  # no connector: whole requests only
    if not isinstance(transfer, dict) or transfer.get("kv_role") not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role is not one of {', '.join(KV_ROLES)}")
    connector = transfer.get("kv_connector")
    return KV_ROLES[transfer["kv_role"]], CONNECTOR_PROTOCOLS.get(connector) if isinstance(connector, str) else None
