"""PrefillWorker: batched, chunked prefill whose KV is pushed layer by layer while the model runs.

The worker owns the transport: it connects to the decode worker and starts a ``SendTransfer`` to
its reserved blocks. The engine owns the blocks: ``add_prefill`` hands it the transfer as the
request's KV sender, and the engine's KV connector (pdserve/kv_connector.py) sends each layer of
the completed prompt while the next layer computes (straight from the pools into the decode
worker's blocks when those are in few runs, else gathered into a message buffer first), then the
first token after sampling. Blocks a direct transfer still reads stay allocated (held by the
engine) until the worker says the transfer is over (``release_held``), whichever way it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

from pdserve import rpc, telemetry
from pdserve.engine import AdmissionError, LLMEngine
from pdserve.engine_loop import EngineLoop
from pdserve.metrics import WorkerMetrics
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import KVTransport, PeerHandle, SendTransfer, TransferStats

MAX_WARMING = 8  # warm-ups waiting on a prefill worker; more are refused (PrefillWorker.warm)


@dataclass
class Destination:
    kv_address: bytes
    transfer_id: int
    block_ids: list[int]  # the decode worker's, for the prompt's blocks after skip_blocks
    timeout_s: float
    skip_blocks: int = 0  # the prompt's leading blocks the decode worker holds already
    decode_idle: bool = False  # it runs nothing else: its cores may be borrowed for this prompt


class PrefillWorker:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport,
        metrics: WorkerMetrics | None = None,
        borrow_cpus: frozenset[int] = frozenset(),
    ) -> None:
        """``borrow_cpus``: the cores of the decode worker beside it, which its engine's steps
        also use while every prompt they compute is for an idle decode worker (EngineLoop)."""
        self.engine = engine
        self.transport = transport
        self.metrics = metrics or WorkerMetrics()
        # closed while the worker drains: new requests get UNAVAILABLE, running ones finish
        self.gate = rpc.Gate("this prefill worker is draining (shutting down)")
        observe = self.metrics.step_observer("prefill", lambda: engine.last_step)
        self.loop = EngineLoop(
            engine,
            step_seconds=observe,
            borrow_cpus=borrow_cpus,
            may_borrow=engine.prompts_for_idle_decode,
        )
        self._peers: dict[bytes, PeerHandle] = {}
        self._peers_lock = threading.Lock()
        self._releasing: set[asyncio.Task[None]] = set()  # held blocks freed once sends settle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop.start(loop)

    def stop(self) -> None:
        self.loop.stop()
        self.transport.close()

    def _peer(self, address: bytes) -> PeerHandle:
        with self._peers_lock:
            peer = self._peers.get(address)
            if peer is None or not peer.alive:
                peer = self._peers[address] = self.transport.connect(address)
            return peer

    async def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        dest: Destination,
        parent: telemetry.Context | None = None,
    ) -> tuple[RequestOutput, TransferStats, float]:
        """Prefill, ship the KV to ``dest``; returns the first token, the transfer's stats and the
        share of the transfer that overlapped the model's compute. Traced as ``prefill.prefill``
        with a ``kv.send`` child; the decode side's ``decode.kv_receive`` continues it through the
        transfer header."""
        span = telemetry.start_span(
            "prefill.prefill", parent, {"request_id": request_id, "prompt_tokens": len(prompt_ids)}
        )
        log = telemetry.request_logger(request_id, span)
        try:
            out, stats, overlap = await self._prefill(request_id, prompt_ids, params, dest, span)
        except BaseException as e:
            self.metrics.request_ended(
                "cancelled" if isinstance(e, asyncio.CancelledError) else "error"
            )
            log.warning("prefill.failed", error=str(e) or type(e).__name__)
            telemetry.end_span(span, e)
            raise
        self.metrics.request_ended("ok")
        self.metrics.generated_tokens.inc()
        log.info(
            "prefill.done",
            prompt_tokens=len(prompt_ids),
            cached_prompt_tokens=out.num_cached_tokens,
            kv_skipped_blocks=dest.skip_blocks,
            kv_bytes=stats.nbytes,
            kv_gbps=round(stats.gbps, 3),
            kv_overlap=round(overlap, 3),
            decode_idle=dest.decode_idle,
        )
        telemetry.end_span(span)
        return out, stats, overlap

    async def _prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        dest: Destination,
        span: telemetry.Span,
    ) -> tuple[RequestOutput, TransferStats, float]:
        self.engine.validate(prompt_ids, params)
        ctx = telemetry.context_of(span)
        peer = await asyncio.to_thread(self._peer, dest.kv_address)
        q = self.loop.open_stream(request_id)  # refuses an id in flight, before any send starts
        try:
            tx = self.transport.start_send(
                peer,
                dest.transfer_id,
                len(dest.block_ids),
                dest.timeout_s,
                traceparent=telemetry.traceparent(ctx),
                dst_block_ids=dest.block_ids,
            )
        except BaseException:
            self.loop.close_stream(request_id)
            raise
        done = False
        try:
            send = await self.loop.call(
                lambda e: e.add_prefill(
                    prompt_ids, params, request_id, tx, dest.skip_blocks, dest.decode_idle
                )
            )
            out = await q.get()
            done = True
            span.set_attributes(
                {
                    "queue_wait_s": send.scheduled - send.submitted,
                    "batch_size": send.batch_size,
                    "forward_s": send.compute_end - send.scheduled,
                    "cached_prompt_tokens": out.num_cached_tokens,
                    "kv_skipped_blocks": dest.skip_blocks,
                }
            )
            self.metrics.queue_seconds.observe(send.scheduled - send.submitted)
            try:
                if send.error is not None:
                    raise send.error
                stats = await asyncio.to_thread(tx.wait)
            except BaseException as e:
                self.metrics.transfer_failures.labels("send").inc()
                now = time.time_ns()
                telemetry.record_span(
                    "kv.send",
                    ctx,
                    telemetry.ns_ago(send.first_send) if send.first_send else now,
                    now,
                    {"transfer_id": dest.transfer_id},
                    e,
                )
                raise
            overlap = send.overlap_fraction(stats.seconds)
            self.metrics.transfer("send", stats.nbytes, stats.seconds)
            end = time.time_ns()
            telemetry.record_span(
                "kv.send",
                ctx,
                end - int(stats.seconds * 1e9),
                end,
                {**stats.attributes(), "overlap_fraction": overlap, "direct": tx.direct},
            )
            return out, stats, overlap
        finally:
            self.loop.close_stream(request_id)
            if done:  # tx.wait() has returned or raised: no send reads the pools any more
                await self.loop.cleanup(lambda e: e.release_held(request_id))
            else:
                await self.loop.cleanup(lambda e: e.abort_request(request_id))
                task = asyncio.create_task(self._release_when_settled(request_id, tx))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)

    async def warm(
        self, request_id: str, token_ids: list[int], parent: telemetry.Context | None = None
    ) -> int:
        """Compute ``token_ids`` only to keep their KV in this worker's prefix cache (a chat's
        prompt and reply, which the gateway sends after the reply ended: ``--warm-replies``), in
        engine steps that compute no other prompt. Returns the tokens found cached. Refused
        (AdmissionError) while ``MAX_WARMING`` warm-ups wait here: they would be stale by then."""
        if len(self.engine.scheduler.warming) >= MAX_WARMING:
            raise AdmissionError(
                f"{MAX_WARMING} warm-ups wait on this prefill worker already; this one is dropped"
            )
        span = telemetry.start_span(
            "prefill.warm", parent, {"request_id": request_id, "prompt_tokens": len(token_ids)}
        )
        q = self.loop.open_stream(request_id)  # refuses an id in flight
        done = False
        try:
            await self.loop.call(lambda e: e.add_warm(token_ids, request_id))
            out = await q.get()
            done = True
        except BaseException as e:
            telemetry.end_span(span, e)
            raise
        finally:
            self.loop.close_stream(request_id)
            if not done:
                await self.loop.cleanup(lambda e: e.abort_request(request_id))
        computed = len(token_ids) - out.num_cached_tokens
        self.metrics.warmed_tokens.inc(computed)
        span.set_attribute("cached_prompt_tokens", out.num_cached_tokens)
        telemetry.end_span(span)
        telemetry.request_logger(request_id, span).info(
            "prefill.warm", tokens=len(token_ids), computed=computed
        )
        return out.num_cached_tokens

    async def _release_when_settled(self, request_id: str, tx: SendTransfer) -> None:
        """Free the blocks an abandoned request's sends may still read, once they have ended
        (completed, failed, or past their deadline: ``wait`` returns by then)."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(tx.wait)
        await self.loop.cleanup(lambda e: e.release_held(request_id))
