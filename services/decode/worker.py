"""DecodeWorker: admission by reservation, KV landing into reserved blocks, continuous decode.

gateway                      DecodeWorker                           prefill worker
admit()            --->      reserve blocks (engine thread)
                   <---      Admission(transfer id, block ids)
                             transport.expect(...)        <--- KV, layer by layer
stream()                     await all layers (deadline)
                   <---      activate(first token) -> tokens 2..N
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.services import lifecycle

from pdserve import rpc, telemetry
from pdserve.engine import AdmissionError, LLMEngine
from pdserve.engine_loop import EngineLoop
from pdserve.metrics import WorkerMetrics
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import (
    KVTransport,
    PoolDestination,
    RecvTransfer,
    TransferError,
    TransferStats,
)


async def _over(recv: RecvTransfer) -> None:
    """Until the transfer is over, whichever way it ends (it may not have settled yet)."""
    if recv.future.cancelled():
        return
    try:
        await asyncio.shield(asyncio.wrap_future(recv.future))
    except TransferError:
        pass


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass
class Admission:
    request_id: str
    transfer_id: int
    block_ids: list[int]
    deadline_unix_ms: int
    recv: RecvTransfer
    parent: telemetry.Context | None = None  # the gateway's request span
    admitted_ns: int = 0
    num_prompt_tokens: int = 0
    num_cached_blocks: int = 0  # prompt blocks shared from the prefix cache: not transferred
    done: bool = False  # finished, or released


class _Generation:
    """The ``decode.generate`` span and the metrics of one request's tokens on this worker."""

    def __init__(self, metrics: WorkerMetrics, request_id: str, parent, **attributes) -> None:
        self.metrics = metrics
        self.span = telemetry.start_span(
            "decode.generate", parent, {"request_id": request_id, **attributes}
        )
        self.log = telemetry.request_logger(request_id, self.span)
        self.started = time.perf_counter()
        self.num_tokens = 0
        self.finish_reason = ""
        self.closed = False

    def add(self, out: RequestOutput) -> None:
        if out.new_token_ids and not self.num_tokens:
            self.span.set_attribute("first_token_s", time.perf_counter() - self.started)
        self.num_tokens += len(out.new_token_ids)
        self.metrics.generated_tokens.inc(len(out.new_token_ids))
        self.finish_reason = out.finish_reason or ""
        if out.finished:
            # Counted before the last output is yielded: once the client has it, the metrics
            # and the log already say the request ended (the generator's ``finally`` runs only
            # when its consumer asks for more, after the client may have read the counters).
            self.close()

    def close(self, error: BaseException | str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.span.set_attributes(
            {"completion_tokens": self.num_tokens, "finish_reason": self.finish_reason}
        )
        if error is None and self.finish_reason:
            self.metrics.request_ended("ok")
            self.log.info(
                "decode.end", completion_tokens=self.num_tokens, finish_reason=self.finish_reason
            )
            telemetry.end_span(self.span)
            return
        error = error or "the request ended before it finished (cancelled)"
        self.metrics.request_ended("cancelled" if isinstance(error, str) else "error")
        self.log.warning("decode.end", completion_tokens=self.num_tokens, error=str(error))
        telemetry.end_span(self.span, error)


class _Probe(_Generation):
    """A gateway's liveness probe (request id ``probe-<n>``, see services/gateway/watchdog.py):
    served like any request, but not counted, logged or traced as one."""

    def __init__(self) -> None:
        pass

    def add(self, out: RequestOutput) -> None:
        pass

    def close(self, error: BaseException | str | None = None) -> None:
        pass


class DecodeWorker:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport | None,
        metrics: WorkerMetrics | None = None,
        borrow_cpus: frozenset[int] = frozenset(),
        stream_interval_s: float | None = None,
    ) -> None:
        """``borrow_cpus``: the cores of the prefill worker beside it, which its engine's steps
        also use while no KV is on its way here (EngineLoop._borrow); ``stream_interval_s``: a
        request's tokens are handed on at most this often (EngineLoop._coalesce; None: auto)."""
        self.engine = engine
        self.transport = transport
        self.metrics = metrics or WorkerMetrics()
        phase = "decode" if transport is not None else "mixed"
        # closed while the worker drains: new requests get UNAVAILABLE, running ones finish
        self.gate = rpc.Gate("this decode worker is draining (shutting down)")
        observe = self.metrics.step_observer(phase, lambda: engine.last_step)
        self.loop = EngineLoop(
            engine,
            step_seconds=observe,
            borrow_cpus=borrow_cpus,
            may_borrow=lambda: not engine.kv_on_its_way(),
            stream_interval_s=stream_interval_s,
        )
        self._unsettled: set[asyncio.Task[None]] = set()  # blocks freed once a write has landed
        if transport is not None:
            self.metrics.watch_transport(transport.counters)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop.start(loop)

    def stop(self) -> None:
        self.loop.stop()
        if self.transport is not None:
            self.transport.close()

    async def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_timeout_s: float,
        parent: telemetry.Context | None = None,
    ) -> Admission:
        """Reserve blocks for the whole request and start receiving its KV; AdmissionError if full."""
        span = telemetry.start_span(
            "decode.admit", parent, {"request_id": request_id, "prompt_tokens": len(prompt_ids)}
        )
        try:
            adm = await self._admit(request_id, prompt_ids, params, kv_timeout_s, parent)
        except AdmissionError as e:
            self.metrics.request_ended("resource_exhausted")
            telemetry.end_span(span, e, "RESOURCE_EXHAUSTED")
            raise
        except BaseException as e:
            self.metrics.request_ended("error")
            telemetry.end_span(span, e)
            raise
        span.set_attributes(
            {
                "blocks_reserved": len(adm.block_ids),
                "cached_blocks": adm.num_cached_blocks,
                "transfer_id": adm.transfer_id,
            }
        )
        telemetry.end_span(span)
        return adm

    async def _admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_timeout_s: float,
        parent: telemetry.Context | None,
    ) -> Admission:
        if self.transport is None:
            raise ValueError("this worker has no KV transport; send prefill_locally requests")
        landing = await self.loop.call(lambda e: e.reserve_request(prompt_ids, params, request_id))
        blocks = landing.block_ids
        transfer_id = landing.generation  # never reused: fences off every earlier owner's KV
        try:
            dest = PoolDestination(landing.k_pools, landing.v_pools, blocks)
            recv = self.transport.expect(transfer_id, dest, kv_timeout_s)
        except BaseException:
            await self.loop.cleanup(lambda e: e.abort_request(request_id))
            raise
        deadline_ms = int((time.time() + kv_timeout_s) * 1000)
        block_size = self.engine.scheduler.block_size
        self.metrics.prefix_reused_tokens.inc(landing.num_cached_blocks * block_size)
        return Admission(
            request_id,
            transfer_id,
            list(blocks),
            deadline_ms,
            recv,
            parent=parent,
            admitted_ns=time.time_ns(),
            num_prompt_tokens=len(prompt_ids),
            num_cached_blocks=landing.num_cached_blocks,
        )

    async def stream(self, adm: Admission) -> AsyncIterator[RequestOutput]:
        """Wait for the KV, then yield outputs from the second token on (the gateway already has
        the first from the prefill worker). Any exit before the end frees the request's blocks."""
        rid = adm.request_id
        q = self.loop.open_stream(rid)
        gen: _Generation | None = None
        error: BaseException | None = None
        try:
            await self._received(adm)
            gen = _Generation(self.metrics, rid, adm.parent, prompt_tokens=adm.num_prompt_tokens)
            first = await self.loop.call(lambda e: e.activate_request(rid, adm.recv.token_id))
            adm.done = first.finished
            first.new_token_ids, first.new_text, first.new_logprobs = [], "", []
            gen.add(first)
            yield first  # carries only the finish reason if the first token ended the request
            while not adm.done:
                out = await q.get()
                adm.done = out.finished
                gen.add(out)
                yield out
        except Exception as e:
            error = e
            raise
        finally:
            self.loop.close_stream(rid)
            if gen is not None:
                gen.close(error)
            await self.release(adm)

    async def _received(self, adm: Admission) -> TransferStats:
        """Until the KV has landed; records ``decode.kv_receive`` under the sender's span."""
        recv = adm.recv
        landed = asyncio.wrap_future(recv.future)
        # A request cancelled while it waits leaves ``landed`` to end later (release() fails it):
        # its outcome is retrieved then, or asyncio logs "exception was never retrieved".
        landed.add_done_callback(_retrieve)
        try:
            # shield: a cancelled request must not cancel the transport's future (release() ends it)
            stats = await asyncio.shield(landed)  # TransferError propagates
        except TransferError as e:
            self.metrics.transfer_failures.labels("recv").inc()
            self.metrics.request_ended("error")
            _record_receive(
                adm, {"transfer_id": adm.transfer_id, "layers_received": recv.layers_received}, e
            )
            raise
        self.metrics.transfer("recv", stats.nbytes, stats.seconds)
        _record_receive(adm, stats.attributes())
        return stats

    async def release(self, adm: Admission) -> None:
        """Free an admitted request that will not finish (cancelled, failed); idempotent. Call it
        also when ``stream`` never started: the blocks were reserved at admission."""
        if adm.done:
            return
        adm.done = True
        rid = adm.request_id
        adm.recv.cancel("request ended before its KV arrived")
        await _over(adm.recv)
        if adm.recv.settled.done():
            await self.loop.cleanup(lambda e: e.abort_request(rid))
            return
        # A message was half-way in when the transfer failed (its sender may be stopped): no KV
        # may land in blocks after they are freed, so they stay held until it has completed.
        await self.loop.cleanup(lambda e: (e.hold_landing(rid), e.abort_request(rid)))
        task = asyncio.create_task(self._free_when_settled(adm))
        self._unsettled.add(task)
        task.add_done_callback(self._unsettled.discard)

    async def _free_when_settled(self, adm: Admission) -> None:
        await asyncio.wrap_future(adm.recv.settled)
        await self.loop.cleanup(lambda e: e.release_held(adm.request_id))

    async def generate_local(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        parent: telemetry.Context | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Colocated: prefill and decode here, no transfer."""
        q = self.loop.open_stream(request_id)
        finished = False
        gen = (
            _Probe()
            if request_id.startswith(lifecycle.PROBE_PREFIX)
            else _Generation(
                self.metrics,
                request_id,
                parent,
                prompt_tokens=len(prompt_ids),
                prefill_locally=True,
            )
        )
        error: BaseException | None = None
        try:
            await self.loop.call(lambda e: e.add_request(prompt_ids, params, request_id))
            while not finished:
                out = await q.get()
                finished = out.finished
                gen.add(out)
                yield out
        except Exception as e:
            error = e
            raise
        finally:
            self.loop.close_stream(request_id)
            gen.close(error)
            if not finished:
                await self.loop.cleanup(lambda e: e.abort_request(request_id))


def _record_receive(adm: Admission, attributes: dict, error: BaseException | None = None) -> None:
    """``decode.kv_receive``, from admission until now, under the sender's span (from the KV
    header) when a message arrived, else under the request's."""
    parent = telemetry.from_traceparent(adm.recv.traceparent) or adm.parent
    telemetry.record_span(
        "decode.kv_receive", parent, adm.admitted_ns, time.time_ns(), attributes, error
    )
