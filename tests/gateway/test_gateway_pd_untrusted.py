"""A prefill engine's answer is untrusted: one far larger than a one-token answer with its handoff is not
buffered, and the request goes on to decode without params (the decode engine recomputes)."""

from __future__ import annotations

from proxy_harness import Sink, completion, engine_state, start_server

from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.decider import PdChoice
from gateway.disaggregation.flow import MAX_PREFILL_ANSWER_BYTES, Disaggregation, PdRoute
from gateway.metrics import RouterMetrics
from gateway.proxy import forward
from sim.http_server import HttpRequest, HttpResponse


def _no_estimate(engine: str, work: int, ahead: int) -> float:
    return 0.0


def _no_observation(engine: str, work: int, ahead: int, seconds: float) -> None:
    return None


def _route(prefill_url: str) -> PdRoute:
    prefill = engine_state(prefill_url, "p1")
    return PdRoute(PdChoice(["d1"], ["p1"], "handoff", None), [], [prefill], {})


def _answer(padding: int) -> bytes:
    return (b'{"kv_transfer_params": {"remote_engine_id": "p1"}, "choices": [{"text": "' + b"x" * padding +
            b'"}]}')


async def test_an_oversized_prefill_answer_is_dropped_and_counted(nursery):
    async def huge(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, _answer(MAX_PREFILL_ANSWER_BYTES + 1))

    server = await start_server(nursery, huge)
    metrics = RouterMetrics()
    pd = Disaggregation(PdConfig(), metrics, _no_estimate, _no_observation)
    answer = await pd._prefill(_route(server.url), {"prompt": "hi", "model": "m"}, completion(Sink(), {}), forward)
    assert answer == ("p1", b"")
    assert metrics.pd_leg_failures.labels("prefill", "answer_too_large")._value.get() == 1


async def test_a_prefill_answer_within_the_bound_is_kept_whole(nursery):
    async def fine(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, _answer(1000))

    server = await start_server(nursery, fine)
    pd = Disaggregation(PdConfig(), RouterMetrics(), _no_estimate, _no_observation)
    answer = await pd._prefill(_route(server.url), {"prompt": "hi", "model": "m"}, completion(Sink(), {}), forward)
    assert answer == ("p1", _answer(1000))
