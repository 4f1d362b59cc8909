"""PrefillWorker: batched, chunked prefill whose KV is pushed layer by layer while the model runs.

In the engine thread, after layer i of a forward that completes a prompt, that prompt's blocks of
layer i are handed to the transport (``send_pool_layer``), which sends them while layer i+1
computes: straight from the pools into the decode worker's reserved blocks when those are in few
runs (a direct transfer, transfer/plan.py), else gathered into a message buffer first. The first
token follows after sampling (``finish``). A direct transfer reads the pools until its sends
complete, so the prompt's blocks get one more reference (``BlockAllocator.retain``) when its
first layer leaves, dropped once the transfer is over, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from pdserve import telemetry
from pdserve.engine import LLMEngine
from pdserve.engine_loop import EngineLoop
from pdserve.metrics import WorkerMetrics
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import ScheduledBatch
from pdserve.transfer import KVTransport, PeerHandle, SendTransfer, TransferStats


@dataclass
class Destination:
    kv_address: bytes
    transfer_id: int
    block_ids: list[int]
    timeout_s: float


@dataclass
class _Send:
    tx: SendTransfer
    num_blocks: int
    block_ids: torch.Tensor | None = None  # the prompt's blocks in this step's pools, int64
    retained: list[int] | None = None  # blocks kept allocated while a direct transfer reads them
    ready: bool = False  # every layer handed to the transport: finish() after sampling
    error: BaseException | None = None
    submitted: float = 0.0  # perf_counter when handed to the engine
    scheduled: float = 0.0  # perf_counter when its first forward had run layer 0
    batch_size: int = 0  # prompts in that forward
    first_send: float = 0.0  # perf_counter when layer 0 left
    compute_end: float = 0.0  # perf_counter when sampling ended (the last layer leaves then)


def overlap_fraction(send: _Send, seconds: float) -> float:
    """Share of the transfer's time during which the model was still computing."""
    if seconds <= 0 or not send.first_send:
        return 0.0
    return min(max((send.compute_end - send.first_send) / seconds, 0.0), 1.0)


class PrefillWorker:
    def __init__(
        self, engine: LLMEngine, transport: KVTransport, metrics: WorkerMetrics | None = None
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.metrics = metrics or WorkerMetrics()
        self.loop = EngineLoop(
            engine,
            on_layer=self._on_layer,
            after_step=self._after_step,
            step_seconds=self.metrics.step_seconds.labels("prefill").observe,
        )
        self._sends: dict[str, _Send] = {}
        self._peers: dict[bytes, PeerHandle] = {}
        self._peers_lock = threading.Lock()
        self._num_layers = engine.model_config.num_layers

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
            kv_bytes=stats.nbytes,
            kv_gbps=round(stats.gbps, 3),
            kv_overlap=round(overlap, 3),
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
        num_prompt_blocks = -(-len(prompt_ids) // self.engine.scheduler.block_size)
        if len(dest.block_ids) != num_prompt_blocks:
            raise ValueError(
                f"destination has {len(dest.block_ids)} blocks; the prompt fills {num_prompt_blocks}"
            )
        ctx = telemetry.context_of(span)
        peer = await asyncio.to_thread(self._peer, dest.kv_address)
        tx = self.transport.start_send(
            peer,
            dest.transfer_id,
            num_prompt_blocks,
            dest.timeout_s,
            traceparent=telemetry.traceparent(ctx),
            dst_block_ids=dest.block_ids,
        )
        send = self._sends[request_id] = _Send(tx, num_prompt_blocks, submitted=time.perf_counter())
        q = self.loop.open_stream(request_id)
        done = False
        try:
            one = dataclasses.replace(params, max_tokens=1, stop=())
            await self.loop.call(lambda e: e.add_request(prompt_ids, one, request_id))
            out = await q.get()
            done = True
            span.set_attributes(
                {
                    "queue_wait_s": send.scheduled - send.submitted,
                    "batch_size": send.batch_size,
                    "forward_s": send.compute_end - send.scheduled,
                    "cached_prompt_tokens": out.num_cached_tokens,
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
            overlap = overlap_fraction(send, stats.seconds)
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
            self._sends.pop(request_id, None)
            if not done:
                await self.loop.call(lambda e: e.abort_request(request_id))
            if send.retained is not None:  # the engine thread may have retained them meanwhile
                await self.loop.call(lambda e: self._release(e, send))

    # -- engine thread ------------------------------------------------------------------------

    def _on_layer(
        self, batch: ScheduledBatch, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        for seq, n in batch.prefills:
            send = self._sends.get(seq.request_id)
            if send is None:
                continue
            if not send.scheduled:
                send.scheduled, send.batch_size = time.perf_counter(), len(batch.prefills)
            if send.error is not None or seq.num_computed_tokens + n < seq.num_prompt_tokens:
                continue
            if layer == 0 or send.block_ids is None:  # then the same blocks for every layer
                send.block_ids = torch.tensor(
                    seq.block_table[: send.num_blocks], dtype=torch.long, device=k_cache.device
                )
            try:
                # direct from the pools, or gathered into a message buffer (in C on CPU, a memcpy
                # per run of consecutive blocks); the last layer's first token follows later
                send.tx.send_pool_layer(layer, k_cache, v_cache, send.block_ids)
                if send.tx.direct and send.retained is None:
                    send.retained = seq.block_table[: send.num_blocks]
                    self.engine.allocator.retain(send.retained)
                if not send.first_send:
                    send.first_send = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - reported to the waiting request
                send.error = e
            if layer == self._num_layers - 1:
                send.ready = True

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            send = self._sends.get(out.request_id)
            if send is None or not send.ready or send.error is not None:
                continue
            send.ready = False
            send.compute_end = time.perf_counter()
            try:
                send.tx.finish(token_id=out.new_token_ids[0])
            except Exception as e:  # noqa: BLE001
                send.error = e

    @staticmethod
    def _release(engine: LLMEngine, send: _Send) -> None:
        """Engine thread: drop the reference ``_on_layer`` took for a direct transfer."""
        if send.retained is not None:
            blocks, send.retained = send.retained, None
            engine.allocator.free(blocks)
