"""Tracing and structured logs, set up once per process by ``setup``.

Tracing is OpenTelemetry exported over OTLP/gRPC, on only when an endpoint is given
(``--otlp-endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``); otherwise every span is a no-op. Trace
context is passed explicitly, never through a "current span" global: a servicer extracts its
parent from gRPC metadata (W3C ``traceparent``), hands the span's context to the worker, and
the worker stamps it on the KV transfer header. So a request is one trace across

    gateway.generate ─┬─ router.pick
                      ├─ decode.admit ───────────────── (decode, via gRPC metadata)
                      ├─ prefill.prefill ─┬─ kv.send     (prefill, via gRPC metadata)
                      │                   └─ decode.kv_receive  (decode, via the KV header)
                      └─ decode.generate

Logs are structlog: JSON lines when stderr is not a terminal (containers, tests), readable
key=value lines in a terminal. A request's lines carry request_id, trace_id and span_id (bound
explicitly with ``request_logger``); prompts and outputs are logged only with ``--log-prompts``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve import envs

LOG_FORMATS = ("auto", "json", "console")
_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()
_provider: TracerProvider | None = None
_log_prompts = False

Context = otel_context.Context


@dataclass(frozen=True)
class TelemetryConfig:
    service: str  # gateway, prefill, decode, colocated: exported as pdserve-<service>
    otlp_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off
    log_format: str = "auto"
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log format {self.log_format!r} is not one of {', '.join(LOG_FORMATS)}"
            )


def setup(cfg: TelemetryConfig) -> None:
    """Install the tracer and the log configuration for this process; call once, at start-up."""
    global _tracer, _provider, _log_prompts
    _log_prompts = cfg.log_prompts
    endpoint = cfg.otlp_endpoint or envs.otlp_endpoint()
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        _provider = TracerProvider(
            resource=Resource.create({"service.name": f"pdserve-{cfg.service}"})
        )
        _provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, insecure=insecure), schedule_delay_millis=500
            )
        )
        _tracer = _provider.get_tracer("pdserve")
    _setup_logs(cfg.log_format, cfg.service)


def shutdown() -> None:
    """Flush spans still buffered (at exit)."""
    if _provider is not None:
        _provider.shutdown()


def tracing_enabled() -> bool:
    return _provider is not None


# -- spans ------------------------------------------------------------------------------------


def start_span(
    name: str, parent: Context | None, attributes: dict | None = None, start_ns: int | None = None
) -> Span:
    """A span under ``parent`` (None: a new trace); end it with ``span.end()`` or ``end_span``."""
    return _tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)


def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def end_span(span: Span, error: BaseException | str | None = None, code: str | None = None) -> None:
    """End ``span``; with ``error``, record it and set the span's status to ERROR."""
    if error is not None:
        message = str(error)
        if code:
            span.set_attribute("rpc.grpc.status_code", code)
            message = f"{code}: {message}"
        if isinstance(error, BaseException):
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, message))
    span.end()


def record_span(
    name: str,
    parent: Context | None,
    start_ns: int,
    end_ns: int,
    attributes: dict | None = None,
    error: BaseException | str | None = None,
) -> Span:
    """A span for something already over (its times measured by the caller)."""
    span = start_span(name, parent, attributes, start_ns=start_ns)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=end_ns)
    return span


def ns_ago(perf_then: float) -> int:
    """Wall-clock nanoseconds of a past ``time.perf_counter()`` reading."""
    return time.time_ns() - int((time.perf_counter() - perf_then) * 1e9)


# -- propagation: gRPC metadata and the KV transfer header -------------------------------------


def to_metadata(ctx: Context | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``ctx`` as W3C trace context (empty when tracing is off)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return tuple(carrier.items())


def from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context:
    """The remote parent in an incoming call's metadata (an empty context when there is none)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return _propagator.extract(carrier)


def traceparent(ctx: Context | None) -> str:
    """The ``traceparent`` of ``ctx`` for the KV transfer header ("" when tracing is off)."""
    return dict(to_metadata(ctx)).get("traceparent", "")


def from_traceparent(value: str) -> Context | None:
    return _propagator.extract({"traceparent": value}) if value else None


def ids(span: Span) -> dict[str, str]:
    """trace_id and span_id of ``span`` as hex, for log lines ("" when tracing is off)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return {"trace_id": "", "span_id": ""}
    return {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}


# -- logs -------------------------------------------------------------------------------------


def _setup_logs(fmt: str, service: str) -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    name = f"pdserve-{service}"

    def add_service(_logger, _method, event: dict) -> dict:
        event.setdefault("service", name)
        return event

    structlog.configure(
        processors=[
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def logger(**bound) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)


def request_logger(request_id: str, span: Span) -> structlog.typing.FilteringBoundLogger:
    """A logger whose every line carries the request's id and its span's trace and span ids."""
    return structlog.get_logger().bind(request_id=request_id, **ids(span))


def log_prompts() -> bool:
    """Whether prompts and outputs may appear in logs (``--log-prompts``); off by default."""
    return _log_prompts
