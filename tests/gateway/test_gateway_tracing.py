"""OpenTelemetry spans of a routed request, read from the console exporter of a router process."""

import json
import time

import pytest
from gateway_http import Http, chat

from cluster.router_process import RouterProcess

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def spans(stderr: str) -> list[dict]:
    found = []
    for line in stderr.splitlines():
        if line.startswith("{") and '"trace_id"' in line and '"span_id"' in line:
            found.append(json.loads(line))
    return found


def test_request_spans_follow_genai_conventions_and_continue_the_callers_trace(fleet):
    with RouterProcess(fleet.urls, tracing="console") as proc:
        client = Http(proc.url)
        headers = {"content-type": "application/json", "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
        status, _, _ = client.request("POST", "/v1/chat/completions", chat("trace me " * 30), headers=headers)
        assert status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(s["name"] == "kvmesh.upstream" for s in spans(proc.stderr())):
            time.sleep(0.2)
        found = spans(proc.stderr())
    by_name = {s["name"]: s for s in found}
    root = by_name["chat kvmesh-tiny"]
    assert root["kind"] == "SpanKind.SERVER"
    assert root["context"]["trace_id"] == "0x" + TRACE_ID
    assert root["attributes"]["gen_ai.operation.name"] == "chat"
    assert root["attributes"]["gen_ai.request.model"] == "kvmesh-tiny"
    assert root["attributes"]["gen_ai.usage.input_tokens"] > 0
    root_id = root["context"]["span_id"]
    for child in ("kvmesh.parse", "kvmesh.tokenize", "kvmesh.route", "kvmesh.upstream"):
        assert by_name[child]["parent_id"] == root_id
        assert by_name[child]["context"]["trace_id"] == "0x" + TRACE_ID
    assert by_name["kvmesh.route"]["attributes"]["kvmesh.route.policy"] == "kv_aware"
    assert by_name["kvmesh.upstream"]["attributes"]["kvmesh.outcome"] == "ok"
