"""One simulated vLLM engine: HTTP API, scheduler loop and KV-event publisher in one nursery.

The scheduler task asks the sans-IO core for a step, sleeps the step's modelled duration (times the
time scale and the `slow` fault), then publishes the step's KV events as one batch and hands the
sampled tokens to the waiting HTTP handlers.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import trio
import xxhash
import zmq

from index.media_keys import MediaSpan
from sim.config import EngineConfig
from sim.cpu_tier import CpuTier
from sim.engine_core import EngineCore, SimRequest, TokenOutput
from sim.event_encoding import encode_batch
from sim.http_server import HttpRequest, HttpResponse, serve_http
from sim.kv_cache import Adapter, KVCache
from sim.media import expanded, placeholders
from sim.metrics import EngineMetrics, Snapshot
from sim.openai_api import (
    DONE,
    ApiError,
    GenParams,
    ResponseHead,
    dumps,
    models_body,
    new_id,
    parse_generation,
    parse_json,
    sse,
    usage,
)
from sim.profiles import get_profile
from sim.publisher import EventPublisher
from sim.roles import handoff_params, kv_transfer_config, loadable_tokens, remote_load, transfer_s, wants_handoff
from sim.shared_storage import SharedStorage
from sim.tokenizer import SimTokenizer
from tokenization.messages import RenderError

log = logging.getLogger(__name__)

SSE = "text/event-stream; charset=utf-8"
METRICS = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_GEN_RANGE = (8, 64)


@dataclass(slots=True)
class Faults:
    """Fault knobs set through POST /sim/fault."""

    slow: float = 1.0
    fail_rate: float = 0.0
    fail_status: int = 500
    """What a failed request is answered with (429 comes with a Retry-After)."""
    stall_s: float = 0.0
    """The scheduler sleeps this long before its next step, as a hung GPU (then clears)."""
    stall_after: int = 0
    """Once a request has generated this many tokens, the engine stalls for ``stall_after_s`` (once; 0: never)."""
    stall_after_s: float = 0.0
    error_after: int = 0
    """Streams end with vLLM's mid-stream SSE error event (then ``[DONE]``) after this many tokens (0: never)."""
    die_after: int = 0
    """The engine dies (as with ``die``) once a request has generated this many tokens (0: never)."""
    hold_s: float = 0.0
    """Plain (non-streamed) answers leave this long after their generation ended, as over a congested link."""
    fail_kv_load: bool = False
    """Every load of a prefill engine's blocks fails (an error finish), whatever its lease."""
    omit_handoff: bool = False
    """A prefill engine answers a handoff request without ``kv_transfer_params`` (as vLLM does for a request
    its connector did not keep blocks for)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Where a started engine listens."""

    index: int
    url: str
    port: int
    event_port: int | None
    replay_port: int | None


class SimEngine:
    def __init__(self, cfg: EngineConfig, tokenizer: SimTokenizer, zmq_ctx: zmq.Context) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.profile = get_profile(cfg.profile)
        self.adapters = {name: Adapter(name, path, i + 1) for i, (name, path) in enumerate(cfg.lora_modules)}
        """vLLM numbers adapters from 1 (``lora_int_id``) in the order --lora-modules names them."""
        self.media = placeholders(cfg.media, lambda token: tokenizer.tok.decode([token]))
        tier = None if not cfg.cpu_blocks else CpuTier(
            cfg.cpu_blocks, cfg.block_size * cfg.kv_bytes_per_token / (cfg.cpu_bandwidth_gbps * 1e9))
        self.core = EngineCore(KVCache(cfg.num_blocks, cfg.block_size), self.profile, cfg.max_num_seqs,
                               tokenizer.gen_vocab, cfg.hash_seed, tier, cfg.max_loras, cfg.lora_load_s)
        self.storage = SharedStorage(cfg.kv_shared_path, cfg.block_size) if cfg.kv_shared_path else None
        """ExampleConnector's side of the opaque protocol; None: the handoff protocol (by role)."""
        self.core.connector = kv_transfer_config(cfg.role, cfg.kv_shared_path) is not None
        self.faults = Faults()
        self.created = int(time.time())
        self.success: dict[str, int] = {}
        self.inflight = 0
        self.malformed = 0
        self._zmq_ctx = zmq_ctx
        self._channels: dict[str, trio.MemorySendChannel[TokenOutput]] = {}
        self._wake = trio.Event()
        self._rng = random.Random(cfg.index)
        self._ids = itertools.count()
        self._cancel: trio.CancelScope | None = None
        self.publisher: EventPublisher | None = None
        self.info: EngineInfo | None = None
        self.metrics = EngineMetrics(cfg.model, {
            "block_size": str(cfg.block_size), "num_gpu_blocks": str(cfg.num_blocks),
            "prefix_caching_hash_algo": "sha256", "enable_prefix_caching": "True", "cache_dtype": "auto",
        }, self._snapshot)

    def _snapshot(self) -> Snapshot:
        st = self.core.stats
        return Snapshot(len(self.core.running), len(self.core.waiting), self.core.cache.usage,
                        st.prefix_queries, st.prefix_hits, st.prompt_tokens, st.generation_tokens,
                        st.preemptions, dict(self.success), st.external_queries, st.external_hits,
                        self._lora_info())

    def _lora_info(self) -> dict[str, str] | None:
        """vllm:lora_requests_info's labels, for an engine serving adapters (vLLM exports it with LoRA on)."""
        if not self.adapters:
            return None
        waiting = {r.lora.name for r in self.core.waiting if r.lora is not None}
        return {"max_lora": str(self.core.max_loras), "waiting_lora_adapters": ",".join(sorted(waiting)),
                "running_lora_adapters": ",".join(sorted(self.core.running_adapters()))}

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or killed by the `die` fault."""
        cfg = self.cfg
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        if cfg.events:
            self.publisher = EventPublisher(self._zmq_ctx, cfg.host, cfg.event_port, cfg.replay_port, cfg.topic,
                                            cfg.buffer_steps, cfg.hwm)
        port = listeners[0].socket.getsockname()[1]
        try:
            with trio.CancelScope() as self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._scheduler_loop)
                    if self.publisher is not None:
                        nursery.start_soon(self.publisher.serve_replay)
                    nursery.start_soon(serve_http, listeners, self.handle, cfg.keep_alive_s, cfg.keep_alive_race_s)
                    self.info = EngineInfo(
                        cfg.index, f"http://{cfg.host}:{port}", port,
                        self.publisher.port if self.publisher else None,
                        self.publisher.replay_port if self.publisher else None)
                    task_status.started(self.info)
        finally:
            if self.publisher is not None:
                self.publisher.close()
            with trio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()

    async def run_without_network(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Schedule what ``handle`` is asked, without listening or publishing events: in-process tests serve
        ``handle`` over memory streams (``sim.http_server.serve_connection``)."""
        with trio.CancelScope() as self._cancel:
            task_status.started()
            await self._scheduler_loop()

    def _wakeup(self) -> None:
        self._wake.set()

    async def _scheduler_loop(self) -> None:
        while True:
            if not self.core.has_work():
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            if self.faults.stall_s > 0:
                stall, self.faults.stall_s = self.faults.stall_s, 0.0
                await trio.sleep(stall)
            start = trio.current_time()
            result = self.core.step()
            scale = self.cfg.time_scale * self.faults.slow
            await trio.sleep_until(start + result.duration * scale)
            if result.events and self.publisher is not None:
                self.publisher.publish(encode_batch(time.time(), result.events, self.cfg.event_encoding))
            for out in result.outputs:
                chan = self._channels.get(out.request_id)
                if chan is not None:
                    chan.send_nowait(out)
            if not result.outputs and not result.events and result.duration == 0:
                await self._wake.wait()
                self._wake = trio.Event()

    # ---- HTTP --------------------------------------------------------------------------------

    async def handle(self, req: HttpRequest) -> HttpResponse:
        route = (req.method, req.path)
        try:
            if route == ("POST", "/v1/chat/completions"):
                return await self._generate(req, chat=True)
            if route == ("POST", "/v1/completions"):
                return await self._generate(req, chat=False)
            if route == ("GET", "/health"):
                return HttpResponse(200)
            if route == ("GET", "/metrics"):
                return HttpResponse(200, self.metrics.render(), METRICS)
            if route == ("GET", "/load"):
                return HttpResponse(200, dumps({"server_load": self.inflight}))
            if route == ("GET", "/v1/models"):
                return HttpResponse(200, models_body(self.cfg.model, self.tok.path, self.core.max_model_len,
                                                     self.created, self.cfg.lora_modules))
            if route == ("GET", "/kv_event_sources"):
                return HttpResponse(200, dumps({"0": self._events_config()}))
            if route == ("POST", "/tokenize"):
                return self._tokenize(parse_json(req.body))
            if route == ("POST", "/reset_prefix_cache"):
                self.core.request_reset()
                self._wakeup()
                return HttpResponse(200)
            if route == ("GET", "/server_info") and self.cfg.server_dev_mode:
                return self._server_info("config_format=json" in req.query)
            if route == ("POST", "/sim/fault"):
                return self._fault(parse_json(req.body))
        except ApiError as exc:
            self.malformed += 1
            return HttpResponse(exc.status, exc.body())
        if req.path in _KNOWN_PATHS:
            return HttpResponse(405, b'{"detail":"Method Not Allowed"}')
        return HttpResponse(404, b'{"detail":"Not Found"}')

    def _server_info(self, as_json: bool) -> HttpResponse:
        """vLLM's development ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``), with the parts of its
        ``vllm_config`` a router reads: the model and the KV connector's role."""
        config = {"model_config": {"served_model_name": self.cfg.model},
                  "cache_config": {"block_size": self.cfg.block_size},
                  "kv_transfer_config": kv_transfer_config(self.cfg.role, self.cfg.kv_shared_path)}
        return HttpResponse(200, dumps({"vllm_config": config if as_json else str(config),
                                        "vllm_env": {"VLLM_SERVER_DEV_MODE": True}, "system_env": {}}))

    def _events_config(self) -> dict[str, Any]:
        p = self.publisher
        return {
            "enable_kv_cache_events": p is not None,
            "publisher": "zmq" if p is not None else "null",
            "endpoint": f"tcp://*:{p.port}" if p else f"tcp://*:{self.cfg.event_port}",
            "replay_endpoint": f"tcp://*:{p.replay_port}" if p else None,
            "buffer_steps": self.cfg.buffer_steps,
            "hwm": self.cfg.hwm,
            "max_queue_size": 100_000,
            "topic": self.cfg.topic,
        }

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """The prompt's ids after media expansion, and its media items' runs (``sim/media.py``)."""
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and not all(type(t) is int for t in prompt):
            raise ApiError("batched prompts are not simulated; send one prompt per request", param="prompt")
        try:
            if not chat or not self.media:
                return self.tok.prompt_ids(body, "chat" if chat else "completion"), ()
            texts = {modality: p.text for modality, p in self.media.items()}
            return expanded(self.tok.prompt_ids(body, "chat", texts), body, self.cfg.model, self.media)
        except RenderError as exc:
            raise ApiError(exc.message, param=exc.param or ("messages" if chat else "prompt")) from None

    def _tokenize(self, body: dict[str, Any]) -> HttpResponse:
        model = body.get("model")
        if model is not None and model != self.cfg.model and model not in self.adapters:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
        ids, _ = self._prompt_ids(body, chat="messages" in body)
        return HttpResponse(200, dumps({"count": len(ids), "max_model_len": self.core.max_model_len,
                                        "tokens": ids, "token_strs": None}))

    def _fault(self, body: dict[str, Any]) -> HttpResponse:
        f = self.faults
        try:
            if body.get("clear"):
                self.faults = Faults()
                if self.publisher is not None:
                    self.publisher.drop = False
            if "slow" in body:
                f.slow = float(body["slow"])
                if not math.isfinite(f.slow) or f.slow <= 0:
                    raise ValueError("slow must be a positive factor")
            if "fail_5xx" in body:
                v = body["fail_5xx"]
                f.fail_rate = 1.0 if v is True else 0.0 if v is False else min(max(float(v), 0.0), 1.0)
            if "fail_status" in body:
                status = body["fail_status"]
                if type(status) is not int or not 400 <= status <= 599:
                    raise ValueError("fail_status must be an HTTP error status")
                f.fail_status = status
            for key in ("error_after", "die_after"):
                if key in body:
                    if type(body[key]) is not int or body[key] < 0:
                        raise ValueError(f"{key} must be a token count >= 0")
                    setattr(f, key, body[key])
            if "hold" in body:
                f.hold_s = max(float(body["hold"]), 0.0)
            for key in ("fail_kv_load", "omit_handoff"):
                if key in body:
                    setattr(f, key, bool(body[key]))
            if "stall" in body:
                f.stall_s = max(float(body["stall"]), 0.0)
                self._wakeup()
            if "stall_after" in body:
                if type(body["stall_after"]) is not int or body["stall_after"] < 0:
                    raise ValueError("stall_after must be a token count >= 0")
                f.stall_after, f.stall_after_s = body["stall_after"], max(float(body.get("stall_for", 0.0)), 0.0)
            if "drop_events" in body and self.publisher is not None:
                self.publisher.drop = bool(body["drop_events"])
        except (TypeError, ValueError) as exc:
            raise ApiError(f"bad fault: {exc}") from None
        if body.get("reset_cache"):
            self.core.request_reset()
            self._wakeup()
        if body.get("die"):
            assert self._cancel is not None
            self._cancel.cancel()
        return HttpResponse(200, dumps({"slow": self.faults.slow, "fail_5xx": self.faults.fail_rate,
                                        "fail_status": self.faults.fail_status,
                                        "drop_events": bool(self.publisher and self.publisher.drop)}))

    def _make_request(self, params: GenParams, ids: list[int], media: tuple[MediaSpan, ...] = ()) -> SimRequest:
        room = self.core.max_model_len - len(ids)
        prompt_seed = xxhash.xxh64_intdigest(repr(ids).encode())
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise ApiError(
                    f"This model's maximum context length is {self.core.max_model_len} tokens. However, you "
                    f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                    f"{params.max_tokens} in the completion). Please reduce the length of the messages or "
                    "completion.", param="max_tokens")
            max_tokens, reason = params.max_tokens, "length"
        else:
            if room < 1:
                raise ApiError(f"The prompt ({len(ids)} tokens) is longer than the maximum model length of "
                               f"{self.core.max_model_len}.", param="messages")
            max_tokens, reason = min(random.Random(prompt_seed).randint(*DEFAULT_GEN_RANGE), room), "stop"
        return SimRequest(
            request_id=f"req-{next(self._ids)}",
            prompt_ids=ids, max_tokens=max_tokens, finish_reason=reason,
            rng=random.Random(params.seed if params.seed is not None else prompt_seed),
            cache_salt=params.cache_salt, report_full=params.report_full,
            lora=None if params.adapter is None else self.adapters[params.adapter], media=media,
        )

    async def _generate(self, req: HttpRequest, chat: bool) -> HttpResponse:
        body = parse_json(req.body)
        params = parse_generation(body, self.cfg.model, chat, self.adapters)
        if self.faults.fail_rate and self._rng.random() < self.faults.fail_rate:
            status = self.faults.fail_status
            retry = [("retry-after", "2")] if status == 429 else []
            return HttpResponse(status, ApiError("simulated engine failure", status=status).body(), headers=retry)
        ids, media = self._prompt_ids(body, chat)
        sreq = self._make_request(params, ids, media)
        head = ResponseHead(new_id(chat), int(time.time()), self.cfg.model, chat)
        handoff = self.storage is None  # a shared-folder connector hands no kv_transfer_params over
        load = remote_load(body, time.time()) if handoff and self.cfg.role != "prefill" else None
        if self.storage is not None:
            sreq.external_tokens = self.storage.matched_tokens(ids, media)
        elif load is not None:
            if load.expired or self.faults.fail_kv_load:
                return self._failed_load(head, params)
            sreq.external_tokens = loadable_tokens(load, len(ids), self.cfg.block_size)
        if params.stream:
            return HttpResponse(200, content_type=SSE, stream=self._stream(head, sreq, params))
        texts: list[str] = []
        last: TokenOutput | None = None
        async for out in self.run_request(sreq):
            texts.append(self.tok.token_text[out.token_id])
            last = out
        assert last is not None and last.finish_reason is not None
        use = usage(len(ids), len(texts), last.cached_tokens)
        asked = handoff and self.cfg.role != "decode" and wants_handoff(body) and not self.faults.omit_handoff
        extra = self._handoff(sreq) if asked else None
        await trio.sleep(self.faults.hold_s)
        return HttpResponse(200, head.full_response("".join(texts), last.finish_reason, use, extra))

    def _handoff(self, sreq: SimRequest) -> dict[str, Any]:
        """A prefill answer's ``kv_transfer_params``: the prompt's cached blocks, held for the lease."""
        assert sreq.hasher is not None and self.info is not None
        ids = sreq.prompt_ids
        blocks = self.core.cache.find_cached_prefix(sreq.hasher.hashes, len(ids) // self.cfg.block_size)
        return handoff_params(f"sim-{self.info.port}", sreq.request_id, self.cfg.host, self.info.port,
                              [b.block_id for b in blocks], len(ids), self.cfg.kv_lease_s)

    def _failed_load(self, head: ResponseHead, params: GenParams) -> HttpResponse:
        """vLLM's answer to a request whose KV load failed (``kv_load_failure_policy = "fail"``)."""
        self.success["error"] = self.success.get("error", 0) + 1
        error = ApiError("Internal server error", status=500)
        if not params.stream:
            return HttpResponse(500, error.body())

        async def events() -> AsyncIterator[bytes]:
            if head.chat:
                yield head.role_chunk()
            yield sse(json.loads(error.body()))
            yield DONE

        return HttpResponse(200, content_type=SSE, stream=events())

    async def _stream(self, head: ResponseHead, sreq: SimRequest, params: GenParams) -> AsyncIterator[bytes]:
        n = 0
        cached = 0
        pending: list[str] = []
        async with aclosing(self.run_request(sreq)) as outputs:
            async for out in outputs:
                if n == 0 and head.chat:
                    yield head.role_chunk()
                n += 1
                cached = out.cached_tokens
                pending.append(self.tok.token_text[out.token_id])
                if (n == 1 or len(pending) >= self.cfg.stream_interval or out.finish_reason is not None
                        or n == self.faults.error_after):
                    yield head.text_chunk("".join(pending), out.finish_reason)
                    pending = []
                if out.finish_reason is None and n == self.faults.error_after:
                    yield sse(json.loads(ApiError("simulated engine failure mid-stream", status=500).body()))
                    yield DONE
                    return
        if params.include_usage:
            yield head.usage_chunk(usage(len(sreq.prompt_ids), n, cached))
        yield DONE

    async def run_request(self, sreq: SimRequest) -> AsyncIterator[TokenOutput]:
        """Run one request through the engine, yielding its tokens; aborts it if abandoned."""
        arrival = trio.current_time()
        send, recv = trio.open_memory_channel[TokenOutput](math.inf)
        self.inflight += 1
        finished = False
        try:
            await trio.sleep(self.profile.frontend_s * self.cfg.time_scale * self.faults.slow)
            if sreq.external_tokens:  # a decode engine pulls the prefill's blocks instead of computing them
                await trio.sleep(transfer_s(self.profile, sreq.external_tokens) * self.cfg.time_scale
                                 * self.faults.slow)
            self._channels[sreq.request_id] = send
            self.core.add(sreq)
            self._wakeup()
            first = True
            sent = 0
            async for out in recv:
                if first:
                    self.metrics.ttft.observe(trio.current_time() - arrival)
                    first = False
                    if self.storage is not None and not sreq.external_tokens:  # its prefill has run
                        self.storage.save(sreq.prompt_ids, sreq.media)
                yield out
                sent += 1
                if sent == self.faults.die_after:
                    assert self._cancel is not None
                    self._cancel.cancel()
                if sent == self.faults.stall_after:
                    self.faults.stall_s, self.faults.stall_after = self.faults.stall_after_s, 0
                if out.finish_reason is not None:
                    finished = True
                    self.success[out.finish_reason] = self.success.get(out.finish_reason, 0) + 1
                    self.metrics.e2e.observe(trio.current_time() - arrival)
                    return
        finally:
            self.inflight -= 1
            self._channels.pop(sreq.request_id, None)
            if not finished:
                self.core.abort(sreq.request_id)


_KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/health", "/metrics", "/load", "/v1/models",
                "/kv_event_sources", "/tokenize", "/reset_prefix_cache", "/sim/fault"}
