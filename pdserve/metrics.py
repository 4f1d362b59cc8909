"""Prometheus metrics of each service, served as text at ``/metrics`` on ``--metrics-port``.

Every service keeps its metrics in a registry of its own (not the process-wide default), so an
in-process test can build several. Gauges that mirror engine state (running and waiting requests,
KV blocks) are read at scrape time from the engine: the numbers are plain int reads.

    gateway   pdserve_requests_total{outcome}            ok, or the gRPC status code (lower case)
              pdserve_requests_without_disaggregation_total   served by a colocated/decode-only worker
              pdserve_retries_total, pdserve_{prompt,completion}_tokens_total
              pdserve_ttft_seconds, pdserve_tpot_seconds, pdserve_itl_seconds, pdserve_queue_seconds
              pdserve_requests_running, pdserve_requests_waiting
              per API key (label ``key``: the key's id, never the key):
              pdserve_key_requests_total{key}, pdserve_key_rejected_total{key,reason}
              (rpm, tpm, concurrency, too_large), pdserve_key_tokens_reserved_total{key},
              pdserve_key_tokens_used_total{key}, pdserve_key_requests_running{key}
              pdserve_auth_failures_total{reason}      missing, malformed, invalid
    workers   pdserve_requests_total{outcome}, pdserve_generated_tokens_total
              pdserve_queue_seconds, pdserve_step_seconds{phase}
              pdserve_step_roofline_fraction{phase}   the step's roofline time / its measured time
              pdserve_roofline_memory_bandwidth_bytes_per_second, pdserve_roofline_gemm_flops_per_second
                                              the rates measured at start (pdserve/roofline.py)
              pdserve_kv_transfer_seconds{direction}, pdserve_kv_transfer_bytes{direction}
              pdserve_kv_transfer_failures_total{direction}
              pdserve_kv_stale_messages_total    KV messages of a reservation that was over, dropped
              pdserve_kv_unsettled_blocks        blocks held until a half-landed write completes
              pdserve_kv_fence_late_writes_total  writes that landed after that hold expired
              pdserve_requests_running, pdserve_requests_waiting, pdserve_kv_blocks{state}
              pdserve_kv_cache_utilization    used / total KV blocks, 0..1 (what a decode
                                              HorizontalPodAutoscaler scales on: deploy/k8s)
              pdserve_batch_utilization       running requests / --max-num-seqs, 0..1
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pdserve.roofline import Roofline, StepWork

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(1, 11))  # 4 KiB .. 1 GiB
# past 1: a model whose weights stay in the cache beats a roofline drawn from memory bandwidth
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None  # /metrics, once served
        self.requests = Counter(
            "pdserve_requests",
            "Requests ended, by outcome: ok or the gRPC status code",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_seconds = Histogram(
            "pdserve_queue_seconds",
            "Seconds a request waited before it was served",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.running = Gauge(
            "pdserve_requests_running", "Requests being served", registry=self.registry
        )
        self.waiting = Gauge(
            "pdserve_requests_waiting", "Requests queued, not yet served", registry=self.registry
        )

    def request_ended(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0 picks a port); returns the address."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return f"{host}:{self._http.server_port}"

    def close(self) -> None:
        """Stop serving ``/metrics`` (if ``serve`` was called); idempotent."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()


class GatewayMetrics(_Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.without_disaggregation = Counter(
            "pdserve_requests_without_disaggregation",
            "Requests served by a colocated or decode-only worker because no prefill worker could take them",
            registry=r,
        )
        self.retries = Counter(
            "pdserve_retries", "Tries of a request on another worker pair", registry=r
        )
        self.placement = Counter(
            "pdserve_placement",
            "Where a request with a prefill and a decode worker to choose from was prefilled: "
            "disaggregated, or on its decode worker (short_prompt, held_here, prefill_busy)",
            ["reason"],
            registry=r,
        )
        self.warm_replies = Counter(
            "pdserve_warm_replies",
            "Finished replies sent to their prefill worker to keep in its prefix cache "
            "(--warm-replies), by outcome: done, refused (too many wait there), failed",
            ["outcome"],
            registry=r,
        )
        self.resumes = Counter(
            "pdserve_resumes",
            "Requests continued on another worker after tokens were streamed (the worker failed)",
            registry=r,
        )
        # the hang watchdog (services/gateway/watchdog.py)
        self.probes = Counter(
            "pdserve_probes",
            "Probes of workers by the gateway, by kind (fast: Stats; real: a 1-token generation) "
            "and result (ok, timeout, error)",
            ["kind", "result"],
            registry=r,
        )
        self.evictions = Counter(
            "pdserve_evictions",
            "Workers evicted by the gateway, by reason (stalled: calls running, no progress; "
            "unresponsive: idle, probes failed; engine_stuck: Stats answers, but its engine's "
            "step runs far past its prediction)",
            ["reason"],
            registry=r,
        )
        self.hang_detection = Histogram(
            "pdserve_hang_detection_seconds",
            "From a worker's last progress (or its failed probe's start, when idle; the start of "
            "its stuck step for engine_stuck) to its eviction",
            buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20),
            registry=r,
        )
        self.rejoins = Counter(
            "pdserve_rejoins",
            "Evicted workers routed to again: they registered again and passed a probe",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of requests served", registry=r
        )
        self.completion_tokens = Counter(
            "pdserve_completion_tokens", "Tokens streamed to clients", registry=r
        )
        self.ttft = Histogram(
            "pdserve_ttft_seconds",
            "Time to first token, at the gateway",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_tpot_seconds",
            "Mean time per output token after the first, per request",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_itl_seconds",
            "Time between two streamed tokens",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.gateway_added = Histogram(
            "pdserve_gateway_added_seconds",
            "What the gateway adds to a request, by phase: first (to its first tokens) and last "
            "(to its last): from its arrival to the first worker call, plus from the worker's "
            "message arriving to its answer being handed to the client's connection",
            ["phase"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.key_requests = Counter(
            "pdserve_key_requests", "Requests admitted, by API key id", ["key"], registry=r
        )
        self.key_rejected = Counter(
            "pdserve_key_rejected",
            "Requests refused by a key's limits: rpm, tpm, concurrency, too_large",
            ["key", "reason"],
            registry=r,
        )
        self.key_tokens_reserved = Counter(
            "pdserve_key_tokens_reserved",
            "Tokens reserved at admission (prompt + max_tokens), by API key id",
            ["key"],
            registry=r,
        )
        self.key_tokens_used = Counter(
            "pdserve_key_tokens_used",
            "Tokens used (prompt + completion) by requests that ended, by API key id",
            ["key"],
            registry=r,
        )
        self.key_running = Gauge(
            "pdserve_key_requests_running", "Requests running, by API key id", ["key"], registry=r
        )
        self.auth_failures = Counter(
            "pdserve_auth_failures",
            "Requests refused UNAUTHENTICATED: missing, malformed, invalid",
            ["reason"],
            registry=r,
        )


class WorkerMetrics(_Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.generated_tokens = Counter(
            "pdserve_generated_tokens", "Tokens sampled by this worker", registry=r
        )
        self.step_seconds = Histogram(
            "pdserve_step_seconds",
            "Seconds of one engine step (a batched forward)",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        # A histogram, not a gauge of a recent average: the fraction differs by the step's kind
        # (a prompt chunk is compute-bound, a decode step memory-bound) and batch, so the
        # operator wants its spread, and a mean over the window of their choice (sum / count).
        self.roofline_fraction = Histogram(
            "pdserve_step_roofline_fraction",
            "Roofline time of an engine step (its bytes at the measured memory bandwidth or its "
            "flops at the measured GEMM rate, the longer) over its measured time; 1 is the limit",
            ["phase"],
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.bandwidth = Gauge(
            "pdserve_roofline_memory_bandwidth_bytes_per_second",
            "Memory read bandwidth measured at start (0: not measured, --no-roofline)",
            registry=r,
        )
        self.gemm_flops = Gauge(
            "pdserve_roofline_gemm_flops_per_second",
            "Matmul rate in the engine's weight format measured at start (0: not measured)",
            registry=r,
        )
        self.roofline: Roofline | None = None
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Seconds of one request's KV transfer",
            ["direction"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Histogram(
            "pdserve_kv_transfer_bytes",
            "Bytes of one request's KV transfer",
            ["direction"],
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures", "KV transfers that failed", ["direction"], registry=r
        )
        self.prefix_reused_tokens = Counter(
            "pdserve_kv_prefix_reused_tokens",
            "Prompt tokens a decode worker's admissions found in its prefix cache (whole blocks), "
            "whose KV was therefore not transferred",
            registry=r,
        )
        self.warmed_tokens = Counter(
            "pdserve_prefill_warm_tokens",
            "Prompt tokens a prefill worker computed only to keep a finished reply's KV in its "
            "prefix cache (the gateway's --warm-replies), in steps no request needed",
            registry=r,
        )
        self.kv_blocks = Gauge("pdserve_kv_blocks", "KV cache blocks", ["state"], registry=r)
        self.kv_utilization = Gauge(
            "pdserve_kv_cache_utilization",
            "Fraction of KV cache blocks in use (reserved by admitted requests), 0 to 1",
            registry=r,
        )
        self.batch_utilization = Gauge(
            "pdserve_batch_utilization",
            "Running requests as a fraction of the most the engine batches (--max-num-seqs)",
            registry=r,
        )

    def watch(
        self,
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        num_free_blocks: Callable[[], int],
        num_total_blocks: int,
        max_num_seqs: int,
    ) -> None:
        """Read these at every scrape."""
        self.running.set_function(num_running)
        self.waiting.set_function(num_waiting)
        self.kv_blocks.labels("free").set_function(num_free_blocks)
        self.kv_blocks.labels("used").set_function(lambda: num_total_blocks - num_free_blocks())
        self.kv_utilization.set_function(
            lambda: (num_total_blocks - num_free_blocks()) / max(num_total_blocks, 1)
        )
        self.batch_utilization.set_function(lambda: num_running() / max(max_num_seqs, 1))

    def watch_roofline(self, roofline: Roofline) -> None:
        """Export the rates measured at start; steps from now on observe their fraction."""
        self.roofline = roofline
        self.bandwidth.set(roofline.rates.bandwidth)
        self.gemm_flops.set(roofline.rates.gemm_flops)

    def step_observer(
        self, phase: str, last_step: Callable[[], StepWork | None]
    ) -> Callable[[float], None]:
        """What the engine loop tells each step's seconds: ``pdserve_step_seconds`` and, with a
        roofline, the step's fraction of it (``last_step()``: the step's work, engine.py)."""
        step_seconds = self.step_seconds.labels(phase)
        fraction = self.roofline_fraction.labels(phase)

        def observe(seconds: float) -> None:
            step_seconds.observe(seconds)
            work = last_step()
            if self.roofline is not None and work is not None and seconds > 0:
                fraction.observe(self.roofline.fraction(work, seconds))

        return observe

    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_seconds.labels(direction).observe(seconds)
        self.transfer_bytes.labels(direction).observe(nbytes)

    def watch_transport(self, counters: Callable[[], Any]) -> None:
        """Read a KV transport's ``counters()`` (fence.py) at every scrape."""
        self.registry.register(_TransportCollector(counters))


class _TransportCollector:
    def __init__(self, counters: Callable[[], Any]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.counters()
        yield CounterMetricFamily(
            "pdserve_kv_stale_messages",
            "KV messages of a transfer whose reservation was over (freed or failing), dropped",
            value=c.stale_messages,
        )
        yield CounterMetricFamily(
            "pdserve_kv_fence_late_writes",
            "KV writes that landed after their blocks were given up (fence timeout): an alarm",
            value=c.late_writes,
        )
        yield GaugeMetricFamily(
            "pdserve_kv_unsettled_blocks",
            "KV blocks of failed transfers held until a message already half-way in completes",
            value=c.unsettled_blocks,
        )
