"""Failed requests are visible: every non-2xx answer is one log line and one count by reason; 503 bodies keep
engine addresses and errno text to the log; metric labels stay bounded; HEAD works on the probe paths."""

from __future__ import annotations

import json
import logging

import pytest
from router_inprocess import MODEL, StubUpstream, assert_openai_error, call, make_router

from gateway.openai_errors import ApiError
from gateway.security.config import AuthConfig

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
PROXY_503 = ApiError(503, "no engine could serve the request (127.0.0.1:9: unreachable (cannot connect to "
                          "127.0.0.1:9: [Errno 111] Connection refused), 127.0.0.1:10: status 503)",
                     code="no_engine_available")


def failures(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvmesh.router" and r.levelno >= logging.WARNING]


def errors_counted(router, endpoint: str, status: int, code: str) -> float:
    return router.metrics.request_errors.labels(endpoint, str(status), code)._value.get()


async def test_a_refused_body_is_logged_once_and_counted(monkeypatch, caplog):
    router = make_router()
    with caplog.at_level(logging.INFO, logger="kvmesh.router"):
        answer = await call(router, "POST", CHAT, b"{", {"x-request-id": "req-7"})
    assert_openai_error(answer, 400)
    [line] = failures(caplog)
    assert (line.request_id, line.tenant, line.status, line.code) == ("req-7", "anonymous", 400,
                                                                      "invalid_request_error")
    assert "not valid JSON" in line.detail
    assert errors_counted(router, CHAT, 400, "invalid_request_error") == 1


async def test_an_upstream_failure_names_engines_in_the_log_only(monkeypatch, caplog):
    router = make_router(StubUpstream(error=PROXY_503))
    with caplog.at_level(logging.INFO, logger="kvmesh.router"):
        answer = await call(router, "POST", CHAT, BODY, {"x-request-id": "req-8"})
    error = assert_openai_error(answer, 503)
    assert error["code"] == "no_engine_available" and "req-8" in error["message"]
    assert b"127.0.0.1" not in answer.body and b"Errno" not in answer.body
    [line] = failures(caplog)
    assert line.status == 503 and line.code == "no_engine_available"
    assert "127.0.0.1:9" in line.detail and "Errno 111" in line.detail
    assert errors_counted(router, CHAT, 503, "no_engine_available") == 1


async def test_an_engine_error_passed_through_is_logged_with_its_attempts(monkeypatch, caplog):
    router = make_router(StubUpstream(status=400))
    with caplog.at_level(logging.INFO, logger="kvmesh.router"):
        answer = await call(router, "POST", CHAT, BODY)
    assert answer.status == 400
    [line] = failures(caplog)
    assert line.code == "engine_error" and line.attempts[0]["status"] == 400 and line.attempts[0]["engine"]
    assert not [r for r in caplog.records if r.message == "routed"]
    assert errors_counted(router, CHAT, 400, "engine_error") == 1


async def test_unauthenticated_and_unknown_paths_are_logged_and_counted(monkeypatch, caplog):
    router = make_router(auth=AuthConfig(enabled=True, admin_keys=["sha256:" + "0" * 64]))
    with caplog.at_level(logging.INFO, logger="kvmesh.router"):
        assert (await call(router, "POST", CHAT, BODY)).status == 401
        assert (await call(router, "GET", "/nope")).status == 404
    assert [(r.status, r.code, r.tenant) for r in failures(caplog)] == [(401, "missing_api_key", None),
                                                                        (404, "not_found", None)]
    assert errors_counted(router, "other", 404, "not_found") == 1


async def test_an_internal_error_is_logged_once(monkeypatch, caplog):
    router = make_router(StubUpstream(error=ZeroDivisionError()))
    with caplog.at_level(logging.INFO, logger="kvmesh.router"):
        assert (await call(router, "POST", CHAT, BODY)).status == 500
    [line] = failures(caplog)
    assert line.message == "internal error" and line.exc_info and line.code == "internal_error"
    assert errors_counted(router, CHAT, 500, "internal_error") == 1


async def test_metric_labels_are_route_templates_not_raw_paths(monkeypatch):
    router = make_router()
    for i in range(50):
        await call(router, "GET", f"/v1/unknown/{i}-{'x' * 100}")
        await call(router, "GET", f"/debug/route{i}")
    await call(router, "POST", "/debug/route", BODY)
    text = router.metrics.render().decode()
    assert "unknown" not in text and "/debug/route0" not in text
    assert 'kvmesh_requests_total{endpoint="other",status="404"} 100.0' in text
    assert 'kvmesh_requests_total{endpoint="/debug/route",status="200"} 1.0' in text


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
async def test_head_answers_like_get_without_a_body(monkeypatch, path):
    router = make_router()
    get = await call(router, "GET", path)
    head = await call(router, "HEAD", path)
    assert head.status == get.status and head.body == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
    assert (await call(router, "HEAD", "/v1/models")).status == 405
