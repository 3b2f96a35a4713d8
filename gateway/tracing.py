"""OpenTelemetry tracing: one server span per request with children for parse, tokenize, route, upstream.

Span names and attributes follow the OpenTelemetry GenAI conventions where they apply (``chat MODEL``,
``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ...). Without an
exporter the API's no-op tracer is used and spans cost next to nothing; ``console`` prints finished spans
as JSON lines on stderr, ``otlp`` sends them over OTLP/HTTP (needs the ``otlp`` extra). The SDK exports
from its own worker thread, which it owns and flushes at exit.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import nullcontext

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.config import TracingConfig
from gateway.config_errors import ConfigError

TRACER_NAME = "kvmesh"
OPERATION = {"chat": "chat", "completion": "text_completion"}
_OFF = nullcontext(trace.INVALID_SPAN)
"""Without an exporter every span is this shared no-op: no span objects or context switches per request."""
_enabled = False


def setup_tracing(config: TracingConfig) -> None:
    """Install a tracer provider for the configured exporter; ``none`` keeps the no-op default."""
    global _enabled
    if config.exporter == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    if config.exporter == "console":
        exporter = ConsoleSpanExporter(out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n")
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError("tracing.exporter: 'otlp' needs pip install 'kvmesh[otlp]'") from None
        exporter = OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _enabled = True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def request_span(kind: str, headers: Mapping[str, str]):
    """The server span of one inference request, continuing the caller's trace if it sent one."""
    if not _enabled:
        return _OFF
    parent = propagate.extract(headers)
    return tracer().start_as_current_span(OPERATION.get(kind, kind), context=parent, kind=SpanKind.SERVER,
                                          attributes={"gen_ai.operation.name": OPERATION.get(kind, kind)},
                                          set_status_on_exception=False)


def name_request(span: trace.Span, kind: str, model: str, max_tokens: int | None, tenant: str) -> None:
    span.update_name(f"{OPERATION.get(kind, kind)} {model}")
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("kvmesh.tenant", tenant)
    if max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", max_tokens)


def step(name: str):
    """A child span for one step of the request path (parse, tokenize, route)."""
    if not _enabled:
        return _OFF
    return tracer().start_as_current_span(f"kvmesh.{name}")


def upstream_span(engine: str, url: str):
    if not _enabled:
        return _OFF
    return tracer().start_as_current_span("kvmesh.upstream", kind=SpanKind.CLIENT,
                                          attributes={"kvmesh.engine": engine, "server.address": url})


def inject(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Upstream headers carrying the current span as ``traceparent`` (replacing the client's)."""
    if not _enabled:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v) for k, v in headers if k not in carrier] + list(carrier.items())


def record_error(span: trace.Span, status: int, message: str) -> None:
    """The answer's status; a 5xx marks the span as failed (a 4xx is the client's doing)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, message))
