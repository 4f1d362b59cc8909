"""A small OTLP/gRPC trace receiver: keeps the spans it is sent, optionally as JSON lines.

It is a real OTLP endpoint (the ``opentelemetry-proto`` TraceService), so anything that exports
OTLP over gRPC (pdserve's services, an OpenTelemetry Collector) can point at it. The tests use it
to check traces end to end, the tracing benchmark uses it as the collector, and the compose
end-to-end test runs it in place of Jaeger (no Jaeger image can be had on machines without a
registry)::

    python -m pdserve.otlp_sink --port 4317 --out /data/spans.jsonl

Each span becomes one flat dict: ``trace_id``, ``span_id``, ``parent_span_id`` (hex, "" for a
root), ``name``, ``service``, ``start_ns``, ``end_ns``, ``status`` ("UNSET", "OK", "ERROR"),
``status_message``, ``attributes`` and ``events`` (name and attributes each).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}

Span = dict[str, Any]


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    """The spans of one export request as flat dicts (see the module docstring)."""
    spans = []
    for rs in request.resource_spans:
        service = _attributes(rs.resource.attributes).get("service.name", "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    {
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "name": s.name,
                        "service": service,
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status": _STATUS.get(s.status.code, str(s.status.code)),
                        "status_message": s.status.message,
                        "attributes": _attributes(s.attributes),
                        "events": [
                            {"name": e.name, "attributes": _attributes(e.attributes)}
                            for e in s.events
                        ],
                    }
                )
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: SpanSink) -> None:
        self.sink = sink

    def Export(self, request, context):
        self.sink.add(flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class SpanSink:
    """Serves the OTLP TraceService on ``host:port`` (0 picks a port) until ``stop``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, out: Path | None = None) -> None:
        self._spans: list[Span] = []
        self._cond = threading.Condition()
        self._out = out.open("a", encoding="utf-8") if out is not None else None
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise ValueError(f"cannot listen on {host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"
        self.server.start()

    def add(self, spans: list[Span]) -> None:
        with self._cond:
            self._spans.extend(spans)
            if self._out is not None:
                for s in spans:
                    self._out.write(json.dumps(s) + "\n")
                self._out.flush()
            self._cond.notify_all()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._cond:
            return [s for s in self._spans if trace_id is None or s["trace_id"] == trace_id]

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float = 10.0) -> list[Span]:
        """All spans once ``done(spans)`` holds; TimeoutError (with what arrived) otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s['service']}/{s['name']}" for s in self._spans})
                    raise TimeoutError(f"spans did not arrive within {timeout:g} s; got {names}")
                self._cond.wait(left)
            return list(self._spans)

    def stop(self) -> None:
        self.server.stop(grace=None)
        if self._out is not None:
            self._out.close()

    def __enter__(self) -> SpanSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.otlp_sink", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=4317)
    p.add_argument("--out", type=Path, default=None, help="append each span as a JSON line here")
    args = p.parse_args(argv)
    sink = SpanSink(args.host, args.port, args.out)
    print(f"READY otlp-sink {args.host}:{sink.port}", flush=True)
    try:
        sink.server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    finally:
        sink.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
