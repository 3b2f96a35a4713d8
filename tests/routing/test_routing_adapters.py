"""LoRA slots: an adapter request is charged a load where its adapter is not running, and a wait where other
adapters hold every slot; the slots are read from vLLM's ``vllm:lora_requests_info``."""

from __future__ import annotations

import pytest

from events.metrics_poller import parse_vllm_metrics
from gateway.adapters import adapter_terms
from gateway.engines import EngineLoad
from gateway.routing import CostModel, EngineView, RouteRequest, make_policy
from gateway.routing.cost import Knowledge

REQUEST = RouteRequest(model="sql", prompt_tokens=256, total_blocks=16, max_tokens=64)
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="base"}} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""}} 1.7e9
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters=""}} 1.8e9
"""


def test_the_newest_lora_info_series_gives_the_slots_and_running_adapters():
    load = parse_vllm_metrics(METRICS.format(running="sql,chat"))
    assert (load.max_lora, load.running_adapters) == (2, frozenset({"sql", "chat"}))
    assert parse_vllm_metrics(METRICS.format(running="")).running_adapters == frozenset()
    plain = parse_vllm_metrics(METRICS.format(running="").split("# HELP vllm:lora")[0])
    assert (plain.max_lora, plain.running_adapters) == (None, frozenset())


def test_adapter_terms_charge_only_where_the_adapter_is_not_running():
    running = EngineLoad(max_lora=2, running_adapters=frozenset({"sql"}))
    full = EngineLoad(max_lora=2, running_adapters=frozenset({"a", "b"}))
    assert adapter_terms("sql", running, 0.01) == (0.0, False)
    assert adapter_terms("sql", EngineLoad(max_lora=2), 0.01) == (0.01, False)
    assert adapter_terms("sql", full, 0.01) == (0.01, True)
    assert adapter_terms(None, full, 0.01) == (0.0, False), "base-model requests use no slot"
    assert adapter_terms("sql", EngineLoad(), 0.01) == (0.0, False), "no slots reported: nothing known"


def view(engine_id: str, load_s: float = 0.0, full: bool = False, running: int = 0) -> EngineView:
    return EngineView(id=engine_id, url=f"http://{engine_id}", adapter_load_s=load_s, adapter_slots_full=full,
                      running=running)


def test_a_full_engine_costs_the_load_and_a_wait_for_a_slot():
    costs = CostModel()
    home = costs.estimate(REQUEST, view("home", running=2), Knowledge.EVENTS)
    free = costs.estimate(REQUEST, view("free", load_s=0.01, running=2), Knowledge.EVENTS)
    full = costs.estimate(REQUEST, view("full", load_s=0.01, full=True, running=2), Knowledge.EVENTS)
    assert home.adapter_s == 0 and free.adapter_s == pytest.approx(0.01)
    assert full.adapter_s == pytest.approx(0.01 + costs.decode.decode_s("full", 2, None))
    assert home.queue_s < free.queue_s < full.queue_s


def test_adapter_requests_gather_where_the_adapter_runs_until_its_queue_costs_more():
    policy = make_policy("kv_aware")
    assert policy.choose(REQUEST, [view("cold", load_s=0.05), view("home")]).chosen == "home"
    busy = [view("cold", load_s=0.001), view("home", running=200)]
    assert make_policy("kv_aware").choose(REQUEST, busy).chosen == "cold"
