"""The route header and the debug table say what was chosen and why."""

from __future__ import annotations

import json
import re

from hypothesis import given
from routing_strategies import fleets, requests

from gateway.routing import EngineView, RouteRequest, make_policy, route_header, route_table

_HEADER = re.compile(r"^engine=[!#-:<-~]+; overlap=\d+/\d+; est_ttft_ms=[\d.]+; reason=[!#-:<-~]+; policy=\w+$")


def test_header_names_engine_overlap_estimate_and_reason():
    request = RouteRequest("m", 2048, 128, "k")
    fleet = [EngineView("e1", "u", exact_blocks=124), EngineView("e2", "u")]
    decision = make_policy("kv_aware").choose(request, fleet)
    header = route_header(decision)
    assert header.startswith("engine=e1; overlap=1984/2048; est_ttft_ms=")
    assert header.endswith("; reason=cache-hit-97%; policy=kv_aware")
    assert float(header.split("est_ttft_ms=")[1].split(";")[0]) == round(decision.table[0].ttft_s * 1000, 1)


@given(fleets(min_size=0), requests())
def test_header_is_always_one_parseable_line_and_table_is_json(fleet, request):
    decision = make_policy("kv_aware").choose(request, fleet)
    header = route_header(decision)
    if decision.ranked:
        assert _HEADER.match(header), header
    else:
        assert header == "engine=none; reason=no-engine; policy=kv_aware"
    table = json.loads(json.dumps(route_table(decision)))
    assert table["ranked"] == decision.ranked
    assert [row["engine"] for row in table["candidates"]] == decision.ranked
    assert [row["rank"] for row in table["candidates"]] == list(range(1, len(decision.ranked) + 1))


def test_table_rows_carry_the_terms_of_the_estimate():
    request = RouteRequest("m", 1000, 62, "k", router_island="west")
    fleet = [EngineView("far", "u", island="east", exact_blocks=62, in_flight=3)]
    row = route_table(make_policy("kv_aware").choose(request, fleet))["candidates"][0]
    assert row["overlap_exact_tokens"] == 992
    assert row["uncached_tokens"] == 8
    assert row["queue_depth"] == 3
    assert row["topology_penalty_ms"] == 10.0
    parts = row["queue_ms"] + row["prefill_ms"] + row["pressure_penalty_ms"] + row["topology_penalty_ms"]
    assert abs(parts - row["est_ttft_ms"]) <= 0.2
