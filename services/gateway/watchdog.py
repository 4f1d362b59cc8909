"""Hang detection: the gateway watches every registered worker and evicts one that stops
progressing, so that its requests resume elsewhere (``gateway._route``'s mid-stream resume).

Two signals, one decision:

- **Progress.** ``Worker.last_progress`` is stamped by the gateway each time a message arrives
  from the worker (``gateway._read``, the Prefill call's answer). A worker with calls of the
  gateway running there (or outstanding tokens) and no message for ``suspect_after_s`` is
  *suspect*, and probed at once.
- **Black-box probes**, every ``probe_interval_s`` for each worker and at once when it is
  suspect or on probation, escalating: the *fast* probe (the Stats RPC, ``probe_timeout_s``:
  answers while the worker's event loop runs), then, on a decode or colocated worker, the
  *real* probe (``Decode.Generate`` with ``prefill_locally``: a 2-token prompt, max_tokens=1,
  request id ``probe-<n>``, ``real_probe_timeout_s``) which joins the engine's continuous batch
  like any request, so it answers within a step or two on a busy worker and never on one whose
  engine thread or process is stuck. A prefill worker has no real probe (Prefill needs a KV
  destination): its fast probe decides, and a prefill worker whose engine thread alone is stuck
  is left to its own stall watchdog (``--stall-timeout``, which deregisters it).

A worker is evicted (``WorkerRegistry.evict``: not routed to, its calls cancelled) when its last
probe failed and nothing arrived from it while the probes ran: a busy worker whose probe waits
behind a long prefill still streams tokens, and is not evicted. An evicted worker rejoins when it
registers again (its next heartbeat is answered "unknown", so it re-registers): it is then on
probation, listed but not routed to, until one probe passes.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.registry import Worker, WorkerRegistry
from pdserve.services.lifecycle import PROBE_PREFIX

from pdserve import telemetry
from pdserve.metrics import GatewayMetrics
from pdserve.v1 import common_pb2, worker_pb2

PROBE_PROMPT = [1, 2]
TICK_S = 0.25  # how often progress is looked at (at most)


class Watchdog:
    """``start()`` in the gateway's event loop, ``await stop()`` when it stops."""

    def __init__(
        self, registry: WorkerRegistry, config: GatewayConfig, metrics: GatewayMetrics
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.log = telemetry.logger()
        self._ids = itertools.count()
        self._probing: dict[Worker, asyncio.Task[None]] = {}
        self._next_probe: dict[Worker, float] = {}
        self._last_ok: dict[Worker, float] = {}  # when a probe last passed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.registry.probation_on_rejoin = True
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probing.clear()

    def stalled_for(self, w: Worker, now: float) -> float:
        """Seconds since ``w`` last progressed while the gateway had work there; 0 when idle."""
        if not (w.calls or w.outstanding_tokens):
            return 0.0
        return now - w.last_progress

    async def _watch(self) -> None:
        tick = min(TICK_S, self.config.suspect_after_s / 4)
        while True:
            now = time.monotonic()
            for w in list(self.registry.workers.values()):
                if w in self._probing or not (w.registered or _static_evicted(w)):
                    continue
                stalled = w.registered and self.stalled_for(w, now) > self.config.suspect_after_s
                if stalled or w.probation or now >= self._next_probe.get(w, 0.0):
                    why = "stalled" if stalled else "probation" if w.probation else "interval"
                    if stalled:
                        self.log.warning(
                            "worker.suspect",
                            worker_id=w.worker_id,
                            address=w.address,
                            role=w.role,
                            no_progress_s=round(now - w.last_progress, 3),
                            calls=len(w.calls),
                        )
                    task = asyncio.create_task(self._probe(w, why))
                    self._probing[w] = task
                    task.add_done_callback(lambda _t, w=w: self._probing.pop(w, None))
            await asyncio.sleep(tick)

    async def _probe(self, w: Worker, why: str) -> None:
        started = time.monotonic()
        kind, result = "fast", await self._fast(w)
        if w.role != "prefill":
            kind, result = "real", await self._real(w)
        now = time.monotonic()
        self._next_probe[w] = now + self.config.probe_interval_s
        if result == "ok":
            self._last_ok[w] = now
            if _static_evicted(w):  # a statically listed worker cannot register again
                w.evicted, w.probation = None, True
            if w.probation and w.registered:
                self.registry.rejoined(w)
                self.metrics.rejoins.inc()
                self.log.info("worker.rejoined", worker_id=w.worker_id, address=w.address)
            return
        if w.probation or not w.registered:
            return  # not routed to anyway (it deregistered, drains, or has not passed a probe)
        if w.last_progress > started:
            # Tokens arrived while its probe waited: busy, not hung (a long prefill ahead of it).
            self.log.info(
                "worker.probe_slow", worker_id=w.worker_id, kind=kind, result=result, why=why
            )
            return
        busy = bool(w.calls or w.outstanding_tokens)
        reason = "stalled" if busy else "unresponsive"
        last_alive = max(w.last_progress, self._last_ok.get(w, 0.0))
        detection = now - last_alive
        message = (
            f"no progress for {now - w.last_progress:.1f} s and its {kind} probe: {result}"
            if busy
            else f"its {kind} probe: {result}"
        )
        self.registry.evict(w, message)
        self.metrics.evictions.labels(reason).inc()
        self.metrics.hang_detection.observe(detection)
        self.log.error(
            "worker.evicted",
            worker_id=w.worker_id,
            address=w.address,
            role=w.role,
            reason=reason,
            detail=message,
            detection_s=round(detection, 3),
            calls_cancelled=len(w.calls),
        )

    async def _fast(self, w: Worker) -> str:
        try:
            await w.stub.Stats(worker_pb2.StatsRequest(), timeout=self.config.probe_timeout_s)
            result = "ok"
        except grpc.aio.AioRpcError as e:
            result = _result(e)
        self.metrics.probes.labels("fast", result).inc()
        return result

    async def _real(self, w: Worker) -> str:
        req = worker_pb2.DecodeRequest(
            request_id=f"{PROBE_PREFIX}{next(self._ids)}",
            prompt_token_ids=PROBE_PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            prefill_locally=True,
        )
        call = w.stub.Generate(req, timeout=self.config.real_probe_timeout_s)
        result = "error"
        try:
            async for msg in call:
                if msg.tokens.finish_reason:
                    result = "ok"
                    break
        except grpc.aio.AioRpcError as e:
            result = _result(e)
        finally:
            call.cancel()
        self.metrics.probes.labels("real", result).inc()
        return result


def _result(e: grpc.aio.AioRpcError) -> str:
    return "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "error"


def _static_evicted(w: Worker) -> bool:
    return w.static and w.evicted is not None
