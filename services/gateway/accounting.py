"""One request as the gateway sees it: its root span, its log lines and its latency metrics.

open ──> routed (router.pick span per try) ──> tokens ... ──> close(outcome)
(``with`` the request, it closes with the status the client gets: OK, the status its exception
maps to, or CANCELLED when the client went away)
TTFT = first tokens - open;  ITL = gap between streamed tokens;  TPOT = (last - first) / (n - 1)
"""

from __future__ import annotations

import asyncio
import time

import grpc
from pdserve.services.errors import STATUS_CODES

from pdserve import telemetry
from pdserve.metrics import GatewayMetrics
from pdserve.rpc import status_of


class GatewayRequest:
    def __init__(
        self,
        request_id: str,
        parent: telemetry.Context | None,
        metrics: GatewayMetrics,
        model: str,
        policy: str,
        stream: bool,
    ) -> None:
        self.request_id = request_id
        self.worker_request_id = request_id  # what the workers know it by (Gateway.open)
        self.affinity_key = ""  # the client's (Gateway.generate): routed by
        self.metrics = metrics
        self.policy = policy
        self.span = telemetry.start_span(
            "gateway.generate", parent, {"request_id": request_id, "model": model, "stream": stream}
        )
        self.ctx = telemetry.context_of(self.span)
        self.log = telemetry.request_logger(request_id, self.span)
        self.opened = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.num_tokens = 0
        self.num_prompt_tokens = 0
        # of the prompt, taken from a prefix cache by the worker that computed it (Usage)
        self.num_cached_prompt_tokens = 0
        self.finish_reason = ""
        # what the gateway adds: seconds from opened to the first worker call, and from a
        # worker's message arriving to its delta being handed to the client's transport (first,
        # latest); ``forwarded`` is told by the API layer
        self.before_call_s: float | None = None
        self.forward_s: list[float] = []
        self.text: list[str] = []  # kept only when prompts and outputs may be logged
        self._closed = False
        metrics.running.inc()

    def prepared(self, prompt_ids: list[int], max_tokens: int, prompt_text: str | None) -> None:
        self.num_prompt_tokens = len(prompt_ids)
        self.span.set_attributes({"prompt_tokens": len(prompt_ids), "max_tokens": max_tokens})
        extra = (
            {"prompt": prompt_text} if telemetry.log_prompts() and prompt_text is not None else {}
        )
        self.log.info(
            "request.start", prompt_tokens=len(prompt_ids), max_tokens=max_tokens, **extra
        )

    def routed(
        self,
        mode: str,
        decode: str,
        prefill: str,
        attempt: int,
        placement: str = "",
        why: dict | None = None,
    ) -> None:
        """Record one routing decision as a ``router.pick`` span (it takes no measurable time);
        ``why``: what placement weighed (its attributes and the log line's)."""
        now = time.time_ns()
        why = why or {}
        telemetry.record_span(
            "router.pick",
            self.ctx,
            now,
            now,
            {
                "policy": self.policy,
                "mode": mode,
                "decode": decode,
                "prefill": prefill,
                "attempt": attempt,
                "placement": placement,
                **why,
            },
        )
        if attempt == 0:
            self.before_call_s = time.perf_counter() - self.opened
            self.metrics.queue_seconds.observe(self.before_call_s)
        if mode != "disaggregated" and not placement:  # not by choice: no prefill worker
            self.metrics.without_disaggregation.inc()
        self.span.set_attributes(
            {
                "mode": mode,
                "decode_worker": decode,
                "prefill_worker": prefill,
                "attempts": attempt + 1,
                "placement": placement,
            }
        )
        self.log.info(
            "request.routed",
            mode=mode,
            decode=decode,
            prefill=prefill,
            attempt=attempt,
            placement=placement,
            **why,
        )

    def tokens(self, n: int, text: str, finish_reason: str) -> None:
        if n:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.opened)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self.last) / n)
            self.last = now
            self.num_tokens += n
        if telemetry.log_prompts():
            self.text.append(text)
        self.finish_reason = finish_reason or self.finish_reason

    def forwarded(self, received_at: float) -> None:
        """A delta whose worker message arrived at ``received_at`` (``time.perf_counter``) has
        been handed to the client's connection: written or buffered (HTTP), or yielded to
        grpc.aio, which starts its send at once (the client has it ~0.5 ms later; the write's
        completion reaches this loop several ms after that, bench/grpc_send_timing.py)."""
        spent = time.perf_counter() - received_at
        if self.forward_s:
            self.forward_s[1:] = [spent]
        else:
            self.forward_s.append(spent)

    def __enter__(self) -> GatewayRequest:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.close(grpc.StatusCode.CANCELLED, "the client went away")
        else:
            self.close(*status_of(exc, STATUS_CODES))

    def close(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        """End the request: ``code`` None for success, else the status the client gets."""
        if self._closed:
            return
        self._closed = True
        m = self.metrics
        m.running.dec()
        outcome = "ok" if code is None else code.name.lower()
        m.request_ended(outcome)
        attrs = {
            "completion_tokens": self.num_tokens,
            "finish_reason": self.finish_reason,
            "outcome": outcome,
        }
        if self.first is not None:
            attrs["ttft_s"] = self.first - self.opened
        if self.num_tokens > 1:
            attrs["tpot_s"] = (self.last - self.first) / (self.num_tokens - 1)
        if self.before_call_s is not None and self.forward_s:
            attrs["gateway_added_ttft_s"] = self.before_call_s + self.forward_s[0]
            attrs["gateway_added_s"] = self.before_call_s + self.forward_s[-1]
        if code is None:
            if "gateway_added_s" in attrs:
                m.gateway_added.labels("first").observe(attrs["gateway_added_ttft_s"])
                m.gateway_added.labels("last").observe(attrs["gateway_added_s"])
            m.prompt_tokens.inc(self.num_prompt_tokens)
            m.completion_tokens.inc(self.num_tokens)
            if "tpot_s" in attrs:
                m.tpot.observe(attrs["tpot_s"])
        self.span.set_attributes(attrs)
        extra = {"output": "".join(self.text)} if telemetry.log_prompts() else {}
        if code is None:
            self.log.info("request.end", **attrs, **extra)
            telemetry.end_span(self.span)
        else:
            self.log.warning("request.end", **attrs, error=message, **extra)
            telemetry.end_span(self.span, message, code.name)
