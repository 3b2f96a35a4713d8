"""A simulated engine's side of prefill/decode disaggregation, as vLLM's NixlConnector shows it on the wire.

A ``prefill`` engine asked for a handoff (``kv_transfer_params.do_remote_decode``) answers with a top-level
``kv_transfer_params`` naming its blocks, and holds them under a lease (``kv_lease_s``, vLLM's
``kv_lease_duration``, 30 s by default). A ``decode`` engine given such params (``do_remote_prefill``)
loads the prompt's full blocks instead of computing them: it charges the transfer (bytes per block over
the link, from the profile) instead of the prefill, and counts the loaded tokens as external prefix-cache
hits (``vllm:external_prefix_cache_hits``). A load whose lease has run out fails the request with an error
finish, as vLLM does with ``kv_load_failure_policy = "fail"`` (its default): a 500 for a plain answer, an
SSE error event after the role chunk for a stream.

The lease's end travels as ``remote_blocks_expiry_time`` (wall clock), which vLLM sets in its push mode;
the simulated engines share one machine's clock, so a decode engine can tell an expired lease on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sim.profiles import Profile

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """What a decode leg asks to load: the prefill's token count, and whether its lease is already over."""

    tokens: int
    expired: bool


def wants_handoff(body: dict[str, Any]) -> bool:
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def remote_load(body: dict[str, Any], now_wall: float) -> RemoteLoad | None:
    """The load a decode leg's ``kv_transfer_params`` ask for; None when they ask for none."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    tokens = params.get("remote_num_tokens")
    expiry = params.get("remote_blocks_expiry_time")
    tokens = tokens if type(tokens) is int and tokens > 0 else 0
    expired = isinstance(expiry, int | float) and not isinstance(expiry, bool) and expiry < now_wall
    return RemoteLoad(tokens, expired)


def handoff_params(engine_id: str, request_id: str, host: str, port: int, block_ids: list[int],
                   num_tokens: int, lease_s: float) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill answer, with vLLM's field names."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids,
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": time.time() + lease_s, "transfer_mode": "read"}


def loadable_tokens(load: RemoteLoad, prompt_tokens: int, block_size: int) -> int:
    """Full blocks of the prompt the decode engine may load; the last prompt token is always computed
    (so the engine samples the first token itself)."""
    return min(load.tokens, prompt_tokens - 1) // block_size * block_size


KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def kv_transfer_config(role: str, shared_path: str | None) -> dict[str, Any] | None:
    """The engine's ``kv_transfer_config`` as vLLM's development ``/server_info`` dumps it: ExampleConnector
    over the shared folder, NixlConnector for a prefill or decode engine without one, none otherwise."""
    if shared_path is not None:
        return {"kv_connector": "ExampleConnector", "kv_role": KV_ROLES[role],
                "kv_connector_extra_config": {"shared_storage_path": shared_path}}
    if role == "both":
        return None
    return {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role], "kv_connector_extra_config": {}}


def transfer_s(profile: Profile, tokens: int) -> float:
    """Seconds to pull ``tokens`` of KV cache over the link (engine time, before the time scale)."""
    return tokens * profile.kv_bytes_per_token / profile.link_bytes_per_s
