"""Hang detection: the gateway watches every registered worker and evicts one that stops
progressing, so that its requests resume elsewhere (``gateway._route``'s mid-stream resume).

- **Progress.** ``Worker.last_progress`` is stamped by the gateway each time a message arrives
  from the worker (``calls.read``, the Prefill call's answer). A worker with calls of the
  gateway running there (or outstanding tokens) and no message for ``suspect_after_s`` is
  *suspect*: logged, and both its probes run at once (and again each suspect_after_s while
  it stays suspect, each kind one at a time).
- **Fast probe**: the Stats RPC, every ``probe_interval_s``, ``probe_timeout_s``. It answers
  while the worker's process and event loop run, whatever its engine is doing. When it fails,
  a real probe given ``real_probe_timeout_s`` confirms, then the worker is evicted.
- **Real probe** (decode and colocated workers): ``Decode.Generate`` with ``prefill_locally``,
  a 2-token prompt, max_tokens=1, request id ``probe-<gateway tag>-<n>`` (workers do not
  count, log or trace those), every ``real_probe_interval_s``, ``engine_timeout_s``. It joins
  the engine's continuous batch like any request: it answers after a step or two on a busy
  worker, never on one whose engine is stuck. A CPU step with a 1,024-token prefill chunk can
  take seconds, hence the long deadline of this probe on a worker that answers Stats.
- **Engine progress** (every role): the Stats answer says how long the worker's engine has
  been in its current step and how long that step should take, predicted from the worker's
  own recent steps (pdserve/step_cost.py). A step past max(``stuck_step_floor_s``,
  ``stuck_step_factor`` x its prediction) while Stats answers is a stuck engine: the worker is
  evicted at once (reason ``engine_stuck``). A long step that is predicted long (a CPU prefill
  chunk) is not; such a step marks its layers (EngineLoop.progress), so what Stats reports for
  it is the time since its last layer against one layer's share of its prediction. The next fast probe is brought forward to the moment a running step would
  reach its bound, so the eviction comes at most that bound + ``TICK_S`` + a Stats round trip
  after the step began (about 2.3 s by default). The real probe remains the backstop.
- A prefill worker has no real probe (Prefill needs a KV destination on a decode worker): its
  fast probe decides, engine progress included.

A worker is evicted (``WorkerRegistry.evict``: not routed to, its calls cancelled, so its
requests resume elsewhere) when a probe failed and nothing arrived from it while that probe ran
(a busy worker whose probe waits behind long steps still streams tokens, and is not evicted),
or when its own engine progress shows a step past its bound (no token can arrive meanwhile:
tokens come out of steps). An
evicted worker rejoins when it registers again (its next heartbeat is answered "unknown", so it
re-registers): it is then on probation, listed but not routed to, until a probe passes.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

import grpc
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.registry import Worker, WorkerRegistry
from pdserve.services.lifecycle import PROBE_PREFIX

from pdserve import telemetry
from pdserve.metrics import GatewayMetrics
from pdserve.v1 import common_pb2, worker_pb2

PROBE_PROMPT = [1, 2]
TICK_S = 0.25  # how often the watchdog looks (at most)


class Watchdog:
    """``start()`` in the gateway's event loop, ``await stop()`` when it stops."""

    def __init__(
        self, registry: WorkerRegistry, config: GatewayConfig, metrics: GatewayMetrics
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.log = telemetry.logger()
        # probe ids unique across gateways: two gateways probing one worker at once with the same
        # id made the worker answer one of them only (the other timed out: a false eviction)
        self._ids = (f"{PROBE_PREFIX}{secrets.token_hex(4)}-{n}" for n in itertools.count())
        # (worker, "fast" | "real") -> the probe running; at most one of each kind per worker
        self._probing: dict[tuple[Worker, str], asyncio.Task[None]] = {}
        self._due: dict[tuple[Worker, str], float] = {}  # when the next one is due
        self._started: dict[tuple[Worker, str], float] = {}  # when the last one started
        self._last_ok: dict[Worker, float] = {}  # when a probe of it last passed
        self._suspect: set[Worker] = set()  # stalled now (logged once per stall)
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

    @staticmethod
    def stalled_for(w: Worker, now: float) -> float:
        """Seconds since ``w`` last progressed while the gateway had work there; 0 when idle."""
        if not (w.calls or w.outstanding_tokens):
            return 0.0
        return now - w.last_progress

    async def _watch(self) -> None:
        cfg = self.config
        tick = min(TICK_S, cfg.suspect_after_s / 4, cfg.probe_interval_s)
        intervals = {"fast": cfg.probe_interval_s, "real": cfg.real_probe_interval_s}
        while True:
            now = time.monotonic()
            for w in list(self.registry.workers.values()):
                if not (_watched(w) or _static_evicted(w)):
                    continue
                stalled = _watched(w) and self.stalled_for(w, now) > cfg.suspect_after_s
                if not stalled:
                    self._suspect.discard(w)
                elif w not in self._suspect:
                    self._suspect.add(w)
                    # info: routine under load (a prefill worker answers only as each prompt is
                    # done, seconds apart on a busy CPU); what the probes find is the warning
                    self.log.info(
                        "worker.suspect",
                        worker_id=w.worker_id,
                        address=w.address,
                        role=w.role,
                        no_progress_s=round(now - w.last_progress, 3),
                        calls=len(w.calls),
                    )
                for kind in ("fast", "real") if w.role != "prefill" else ("fast",):
                    key = (w, kind)
                    if key in self._probing:
                        continue
                    # stalled: at once, and then at most once per suspect_after_s
                    again = now - self._started.get(key, -cfg.suspect_after_s)
                    if (stalled and again >= cfg.suspect_after_s) or now >= self._due.get(key, 0):
                        self._due[key] = now + intervals[kind]
                        self._started[key] = now
                        lane = self._fast_lane if kind == "fast" else self._real_lane
                        why = "stalled" if stalled else "interval"
                        task = asyncio.create_task(self._guarded(lane(w, why), w, kind))
                        self._probing[key] = task
                        task.add_done_callback(lambda _t, key=key: self._probing.pop(key, None))
            await asyncio.sleep(tick)

    async def _guarded(self, lane, w: Worker, kind: str) -> None:
        """A probe lane whose unexpected error is logged, not left in the task (and never
        taken for the worker's failure)."""
        try:
            await lane
        except Exception as e:
            self.log.error(
                "watchdog.error", worker_id=w.worker_id, kind=kind, error=f"{type(e).__name__}: {e}"
            )

    async def _fast_lane(self, w: Worker, why: str) -> None:
        """Stats; when it fails (the process does not answer), a real probe with the short
        deadline confirms before the eviction."""
        started = time.monotonic()
        result, stats = await self._fast(w)
        if stats is not None:
            if self._engine_stuck(w, stats):
                return
            if w.role == "prefill":  # nothing else to try on a prefill worker
                self._passed(w)
            return
        if w.role == "prefill":
            self._failed(w, "fast", result, started, why)
            return
        result = await self._real(w, self.config.real_probe_timeout_s)
        if result == "ok":
            self._passed(w)
        else:
            self._failed(w, "real", result, started, why)

    def _engine_stuck(self, w: Worker, stats: worker_pb2.WorkerStats) -> bool:
        """Evict ``w`` if its engine's current step runs past its bound; else have its next fast
        probe come when that step would reach it. True when it is stuck."""
        cfg = self.config
        busy, predicted = stats.engine_busy_s, stats.engine_step_predicted_s
        bound = max(cfg.stuck_step_floor_s, cfg.stuck_step_factor * predicted)
        if busy <= bound:
            if busy > 0:
                key = (w, "fast")
                soon = time.monotonic() + bound - busy
                self._due[key] = min(self._due.get(key, soon), soon)
            return False
        if w.probation or not _watched(w):
            return True  # not routed to: it stays out until a probe passes
        message = (
            f"engine stuck: its step has run {busy:.2f} s, its bound is {bound:.2f} s "
            f"(predicted {predicted:.2f} s; {stats.engine_steps} steps done), Stats answers"
        )
        self._evict(w, "engine_stuck", message, busy)
        return True

    async def _real_lane(self, w: Worker, why: str) -> None:
        """A 1-token generation, given ``engine_timeout_s``: the process answers, so its engine
        gets long enough for a step or two however long they take."""
        started = time.monotonic()
        result = await self._real(w, self.config.engine_timeout_s)
        if result == "ok":
            self._passed(w)
        else:
            self._failed(w, "real", result, started, why)

    def _passed(self, w: Worker) -> None:
        self._last_ok[w] = time.monotonic()
        if _static_evicted(w):  # a statically listed worker cannot register again
            w.evicted, w.probation = None, True
        if w.probation and w.registered:
            self.registry.rejoined(w)
            self.metrics.rejoins.inc()
            self.log.info("worker.rejoined", worker_id=w.worker_id, address=w.address)

    def _failed(self, w: Worker, kind: str, result: str, started: float, why: str) -> None:
        if w.probation or not _watched(w):
            return  # not routed to (it left, drains, or has not passed a probe) or evicted
        if w.last_progress > started:
            # Tokens arrived while its probe waited: busy, not hung.
            self.log.info(
                "worker.probe_slow", worker_id=w.worker_id, kind=kind, result=result, why=why
            )
            return
        now = time.monotonic()
        busy = bool(w.calls or w.outstanding_tokens)
        reason = "stalled" if busy else "unresponsive"
        detection = now - max(w.last_progress, self._last_ok.get(w, 0.0))
        message = (
            f"no progress for {now - w.last_progress:.1f} s and its {kind} probe: {result}"
            if busy
            else f"its {kind} probe: {result}"
        )
        self._evict(w, reason, message, detection)

    def _evict(self, w: Worker, reason: str, message: str, detection: float) -> None:
        calls = len(w.calls)
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
            calls_cancelled=calls,
        )

    async def _fast(self, w: Worker) -> tuple[str, worker_pb2.WorkerStats | None]:
        stats = None
        try:
            stats = await w.stub.Stats(
                worker_pb2.StatsRequest(), timeout=self.config.probe_timeout_s
            )
            result = "ok"
        except grpc.aio.AioRpcError as e:
            result = _result(e)
        self.metrics.probes.labels("fast", result).inc()
        return result, stats

    async def _real(self, w: Worker, timeout: float) -> str:
        req = worker_pb2.DecodeRequest(
            request_id=next(self._ids),
            prompt_token_ids=PROBE_PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            prefill_locally=True,
        )
        call = w.stub.Generate(req, timeout=timeout)
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


def _watched(w: Worker) -> bool:
    """Not evicted and has not left: registered, or its lease ran out (it stopped heartbeating,
    perhaps while the gateway's calls still run there)."""
    return w.evicted is None and not w.deregistered


def _static_evicted(w: Worker) -> bool:
    return w.static and w.evicted is not None
