"""Prefill/decode disaggregation through a real router process in front of simulated prefill and decode
engines: both protocols, chat and completions, streamed and not, and each failure of a leg.

Two fleets (two prefill engines, two decode engines each) serve the whole module, each behind a router: one
fleet plays the handoff protocol (NixlConnector's), the other the opaque one over a shared folder
(ExampleConnector's), and its router pairs them so. Every test uses prompts of its own, so what
an earlier test left in the caches decides nothing; the tests that kill an engine come last."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest
from gateway_http import MODEL, Http, metric

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration
SIM_LEASE_S = 1.0
ROLES = ("prefill", "prefill", "decode", "decode")


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=4, profile="fast", role=",".join(ROLES), kv_lease=SIM_LEASE_S) as sims:
        yield sims


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-shared")
    with SimFleetProcess(engines=4, profile="fast", role=",".join(ROLES), kv_shared_path=str(folder)) as sims:
        yield sims


def _router(fleet, tmp_path_factory, protocol: str):
    lines = ['policy = "kv_aware"', "metrics_interval_s = 0.2", "[pd]", "lease_margin_s = 0.05",
             "min_prefill_tokens = 256"]
    for i, (url, role) in enumerate(zip(fleet.urls, ROLES, strict=True)):
        lines += ["[[engines]]", f'url = "{url}"', f'id = "{role[0]}{i % 2 + 1}"', f'role = "{role}"',
                  f'kv_protocol = "{protocol}"']
    path = tmp_path_factory.mktemp(protocol) / "router.toml"
    path.write_text("\n".join(lines) + "\n")
    return RouterProcess([], config=str(path), metrics_interval=0.2)


@pytest.fixture(scope="module")
def handoff(fleet, tmp_path_factory):
    with _router(fleet, tmp_path_factory, "handoff") as proc:
        yield Http(proc.await_all_routable().url)


@pytest.fixture(scope="module")
def opaque(shared_fleet, tmp_path_factory):
    with _router(shared_fleet, tmp_path_factory, "opaque") as proc:
        yield Http(proc.await_all_routable().url)


@contextlib.contextmanager
def _faults(fleet):
    """Set faults on engines by id (p1, p2, d1, d2); every fault is cleared after the test."""
    engines = {f"{role[0]}{i % 2 + 1}": Http(url) for i, (url, role) in enumerate(zip(fleet.urls, ROLES,
                                                                                       strict=True))}

    def set_fault(engine_id: str, **fault) -> None:
        status, _, _ = engines[engine_id].json("POST", "/sim/fault", fault)
        assert status == 200

    try:
        yield set_fault
    finally:
        for engine in engines.values():
            with contextlib.suppress(OSError):  # an engine a test killed stays dead
                engine.json("POST", "/sim/fault", {"clear": True})


@pytest.fixture
def faults(fleet):
    with _faults(fleet) as set_fault:
        yield set_fault


@pytest.fixture
def shared_faults(shared_fleet):
    with _faults(shared_fleet) as set_fault:
        yield set_fault


def prompt() -> str:
    """A prompt of its own (about 600 tokens): long enough for a prefill leg, cached nowhere yet."""
    return f"case {uuid.uuid4().hex}: " + "the prefill engine computes this long shared document. " * 60


def stored_prompt(fleet, kind: str) -> str:
    """A prompt of its own whose length ExampleConnector keys alike when storing and when looking up: its
    keys differ, and a decode engine misses, when the length less one is a multiple of the block size (16)."""
    for _ in range(20):  # one length in 16 is refused
        text = prompt()
        _, _, counted = Http(fleet.urls[0]).json("POST", "/tokenize", {k: v for k, v in body(kind, text, False)
                                                                       .items() if k in ("messages", "prompt")})
        if (counted["count"] - 1) % 16:
            return text
    raise AssertionError("no prompt of a storable length in 20 draws")


def body(kind: str, text: str, stream: bool, **extra) -> dict:
    if kind == "chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "seed": 3,
                "stream": stream, **extra}
    return {"model": MODEL, "prompt": text, "max_tokens": 8, "seed": 3, "stream": stream, **extra}


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def ask(client: Http, kind: str, text: str, stream: bool, **extra):
    status, head, raw = client.request("POST", PATHS[kind], body(kind, text, stream, **extra))
    return status, head, raw


def answer_text(kind: str, raw: bytes, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert not any("error" in e for e in events), raw[-400:]
    pieces = [c["delta"].get("content") or "" if kind == "chat" else c["text"]
              for e in events for c in e["choices"]]
    assert raw.endswith(b"data: [DONE]\n\n")
    return "".join(pieces)


def pd_note(head: dict) -> dict[str, str]:
    return dict(part.split("=", 1) for part in head["x-kvmesh-pd"].split("; "))


def engine_metric(fleet, name: str, roles=("decode",)) -> float:
    urls = [url for url, role in zip(fleet.urls, ROLES, strict=True) if role in roles]
    return sum(metric(Http(url), name) for url in urls)


def aggregated(fleet, kind: str, text: str) -> str:
    """What one engine answers alone, for the same request and seed."""
    decode = fleet.urls[ROLES.index("decode")]
    status, _, raw = Http(decode).request("POST", PATHS[kind], body(kind, text, False))
    assert status == 200
    return answer_text(kind, raw, False)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_handoff_protocol_loads_the_prefill_on_decode(fleet, handoff, kind, stream):
    text = prompt()
    loaded = engine_metric(fleet, "vllm:external_prefix_cache_hits_total")
    status, head, raw = ask(handoff, kind, text, stream)
    assert status == 200, raw[:300]
    note = pd_note(head)
    assert note["outcome"] == "disaggregated" and note["prefill"] in ("p1", "p2") and note["protocol"] == "handoff"
    assert answer_text(kind, raw, stream) == aggregated(fleet, kind, text)
    assert engine_metric(fleet, "vllm:external_prefix_cache_hits_total") - loaded > 500


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_opaque_protocol_runs_a_one_token_prefill_leg_then_decode_loads_it(fleet, shared_fleet, opaque, kind,
                                                                           stream):
    text = stored_prompt(shared_fleet, kind)
    prefilled = engine_metric(shared_fleet, "vllm:generation_tokens_total", ("prefill",))
    loaded = engine_metric(shared_fleet, "vllm:external_prefix_cache_hits_total")
    status, head, raw = ask(opaque, kind, text, stream, stream_options={"include_usage": True} if stream else None)
    assert status == 200, raw[:300]
    assert pd_note(head)["outcome"] == "disaggregated" and pd_note(head)["protocol"] == "opaque"
    assert answer_text(kind, raw, stream) == aggregated(fleet, kind, text)
    assert engine_metric(shared_fleet, "vllm:generation_tokens_total", ("prefill",)) - prefilled == 1  # max 1
    # D found the prompt P stored in the shared folder and loaded it instead of computing it
    assert engine_metric(shared_fleet, "vllm:external_prefix_cache_hits_total") - loaded > 500


def test_opaque_protocol_with_a_cold_folder_decode_recomputes(fleet, shared_fleet, opaque, shared_faults):
    """Both prefill engines fail: the decode engine serves the request whole, finding nothing stored."""
    for engine in ("p1", "p2"):
        shared_faults(engine, fail_5xx=True, fail_status=503)
    text = stored_prompt(shared_fleet, "chat")
    loaded = engine_metric(shared_fleet, "vllm:external_prefix_cache_hits_total")
    status, head, raw = ask(opaque, "chat", text, True)
    assert status == 200 and answer_text("chat", raw, True) == aggregated(fleet, "chat", text)
    assert pd_note(head)["outcome"] == "prefill_failed"
    assert engine_metric(shared_fleet, "vllm:external_prefix_cache_hits_total") == loaded


def test_the_decider_skips_the_prefill_leg_and_debug_route_says_why(handoff):
    text = prompt()
    status, head, _ = ask(handoff, "chat", text, False)
    assert pd_note(head)["outcome"] == "disaggregated"
    # The same prompt again: the decode engine now holds all of it (it cached what it loaded).
    status, route, explained = handoff.json("POST", "/debug/route", body("chat", text, False))
    assert status == 200 and explained["pd"]["skipped_because"] == "decode_holds_prompt"
    status, head, _ = ask(handoff, "chat", text, False)
    assert status == 200 and pd_note(head)["outcome"] == "skipped_decode_holds_prompt"
    status, head, _ = ask(handoff, "chat", "short", False)
    assert pd_note(head)["outcome"] == "skipped_short_prompt"
    assert metric(handoff, "kvmesh_pd_requests_total", outcome="skipped_short_prompt") >= 1
    assert metric(handoff, "kvmesh_engine_role", engine="p1", role="prefill") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_missing_params_make_decode_recompute(fleet, handoff, faults, stream):
    faults("p1", omit_handoff=True)
    faults("p2", omit_handoff=True)
    text = prompt()
    loaded = engine_metric(fleet, "vllm:external_prefix_cache_hits_total")
    missing = metric(handoff, "kvmesh_pd_handoffs_total", outcome="missing_params")
    status, head, raw = ask(handoff, "chat", text, stream)
    assert status == 200 and answer_text("chat", raw, stream) == aggregated(fleet, "chat", text)
    assert engine_metric(fleet, "vllm:external_prefix_cache_hits_total") == loaded
    assert metric(handoff, "kvmesh_pd_handoffs_total", outcome="missing_params") - missing >= 1


def test_a_prefill_answer_arriving_after_its_lease_sends_decode_no_params(fleet, handoff, faults):
    """The prefill engines answer 1.3 s after finishing, their blocks held 1 s: the handoff is stale when it
    arrives, so the decode leg goes without it (a decode engine given it would fail the load)."""
    for engine in ("p1", "p2"):
        faults(engine, hold=SIM_LEASE_S + 0.3)
    errors = engine_metric(fleet, "vllm:request_success_total")  # error finishes are counted there too
    text = prompt()
    expired = metric(handoff, "kvmesh_pd_handoffs_total", outcome="lease_expired")
    status, _, raw = ask(handoff, "chat", text, False)
    assert status == 200 and answer_text("chat", raw, False) == aggregated(fleet, "chat", text)
    assert metric(handoff, "kvmesh_pd_handoffs_total", outcome="lease_expired") - expired >= 1
    # two decode answers (the routed one and the reference), and no error finish among them
    assert engine_metric(fleet, "vllm:request_success_total") - errors == 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_finish_on_decode_is_retried_on_another_decode(fleet, handoff, faults, stream):
    faults("d1", fail_kv_load=True)
    faults("d2", fail_kv_load=True)
    text = prompt()
    retried = metric(handoff, "kvmesh_pd_handoffs_total", outcome="retried_without_params")
    continued = metric(handoff, "kvmesh_stream_continuations_total", outcome="continued")
    status, head, raw = ask(handoff, "chat", text, stream)
    assert status == 200 and answer_text("chat", raw, stream) == aggregated(fleet, "chat", text)
    # A whole answer is retried on another decode engine without the handoff; a streamed one has sent its
    # head already, so the error finish breaks the stream and the continuation finishes it elsewhere.
    if stream:
        assert metric(handoff, "kvmesh_stream_continuations_total", outcome="continued") - continued == 1
    else:
        assert metric(handoff, "kvmesh_pd_handoffs_total", outcome="retried_without_params") - retried == 1


def test_prefill_engines_failing_leave_the_request_to_decode(fleet, handoff, faults):
    for engine in ("p1", "p2"):
        faults(engine, fail_5xx=True, fail_status=503)
    failed = metric(handoff, "kvmesh_pd_leg_failures_total", leg="prefill")
    text = prompt()
    status, head, raw = ask(handoff, "chat", text, True)
    assert status == 200 and answer_text("chat", raw, True) == aggregated(fleet, "chat", text)
    assert pd_note(head)["outcome"] == "prefill_failed"
    assert metric(handoff, "kvmesh_pd_leg_failures_total", leg="prefill") - failed == 2  # both tried


def _chosen(client: Http, text: str) -> dict:
    status, _, explained = client.json("POST", "/debug/route", body("chat", text, True))
    assert status == 200
    return explained["pd"]


@pytest.fixture(params=["handoff", "opaque"])
def each_protocol(request):
    """The router of each protocol, with the faults of its fleet."""
    if request.param == "handoff":
        return request.getfixturevalue("handoff"), request.getfixturevalue("faults")
    return request.getfixturevalue("opaque"), request.getfixturevalue("shared_faults")


def test_a_prefill_engine_dying_before_it_answers_is_replaced(fleet, each_protocol):
    client, faults = each_protocol
    text = prompt()
    first = _chosen(client, text)["prefill"][0]
    faults(first, die_after=1)  # dies once its one token is generated, before the answer goes out
    failed = metric(client, "kvmesh_pd_leg_failures_total", leg="prefill")
    status, head, raw = ask(client, "chat", text, False)
    assert status == 200 and answer_text("chat", raw, False) == aggregated(fleet, "chat", text)
    note = pd_note(head)
    assert note["outcome"] == "disaggregated" and note["prefill"] != first
    assert metric(client, "kvmesh_pd_leg_failures_total", leg="prefill") - failed >= 1


def test_a_decode_engine_dying_after_the_first_token_is_continued(each_protocol):
    client, faults = each_protocol
    text = prompt()
    first = _chosen(client, text)["decode"][0]
    faults(first, die_after=3)
    continued = metric(client, "kvmesh_stream_continuations_total", outcome="continued")
    status, head, raw = ask(client, "chat", text, True)
    assert status == 200 and len(answer_text("chat", raw, True)) > 0
    assert metric(client, "kvmesh_stream_continuations_total", outcome="continued") - continued >= 1

