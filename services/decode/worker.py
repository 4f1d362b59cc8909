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
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine import LLMEngine, RequestOutput
from pdserve.engine_loop import EngineLoop
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import KVTransport, RecvTransfer, TransferError, scatter_into


async def _settled(recv: RecvTransfer) -> None:
    """Until the transfer is over, whichever way it ends."""
    if recv.future.cancelled():
        return
    try:
        await asyncio.shield(asyncio.wrap_future(recv.future))
    except TransferError:
        pass


@dataclass
class Admission:
    request_id: str
    transfer_id: int
    block_ids: list[int]
    deadline_unix_ms: int
    recv: RecvTransfer
    done: bool = False  # finished, or released


class DecodeWorker:
    def __init__(self, engine: LLMEngine, transport: KVTransport | None) -> None:
        self.engine = engine
        self.transport = transport
        self.loop = EngineLoop(engine)
        self._transfer_ids = itertools.count(1)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop.start(loop)

    def stop(self) -> None:
        self.loop.stop()
        if self.transport is not None:
            self.transport.close()

    async def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    kv_timeout_s: float) -> Admission:
        """Reserve blocks for the whole request and start receiving its KV; AdmissionError if full."""
        if self.transport is None:
            raise ValueError("this worker has no KV transport; send prefill_locally requests")
        blocks = await self.loop.call(lambda e: e.reserve_request(prompt_ids, params, request_id))
        k_pools = [k for k, _ in self.engine.runner.pool.kv_caches]
        v_pools = [v for _, v in self.engine.runner.pool.kv_caches]
        transfer_id = next(self._transfer_ids)
        try:
            recv = self.transport.expect(transfer_id, len(blocks), scatter_into(k_pools, v_pools, blocks),
                                         kv_timeout_s)
        except BaseException:
            await self.loop.call(lambda e: e.abort_request(request_id))
            raise
        deadline_ms = int((time.time() + kv_timeout_s) * 1000)
        return Admission(request_id, transfer_id, blocks, deadline_ms, recv)

    async def stream(self, adm: Admission) -> AsyncIterator[RequestOutput]:
        """Wait for the KV, then yield outputs from the second token on (the gateway already has
        the first from the prefill worker). Any exit before the end frees the request's blocks."""
        rid = adm.request_id
        q = self.loop.open_stream(rid)
        try:
            # shield: a cancelled request must not cancel the transport's future (release() ends it)
            await asyncio.shield(asyncio.wrap_future(adm.recv.future))  # TransferError propagates
            first = await self.loop.call(lambda e: e.activate_request(rid, adm.recv.token_id))
            adm.done = first.finished
            first.new_token_ids, first.new_text, first.new_logprobs = [], "", []
            yield first  # carries only the finish reason if the first token ended the request
            while not adm.done:
                out = await q.get()
                adm.done = out.finished
                yield out
        finally:
            self.loop.close_stream(rid)
            await self.release(adm)

    async def release(self, adm: Admission) -> None:
        """Free an admitted request that will not finish (cancelled, failed); idempotent. Call it
        also when ``stream`` never started: the blocks were reserved at admission."""
        if adm.done:
            return
        adm.done = True
        adm.recv.cancel("request ended before its KV arrived")
        # No KV may land in blocks after they are freed: wait until the transfer is over.
        await _settled(adm.recv)
        await self.loop.call(lambda e: e.abort_request(adm.request_id))

    async def generate_local(self, request_id: str, prompt_ids: list[int],
                             params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Colocated: prefill and decode here, no transfer."""
        q = self.loop.open_stream(request_id)
        finished = False
        try:
            await self.loop.call(lambda e: e.add_request(prompt_ids, params, request_id))
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self.loop.close_stream(request_id)
            if not finished:
                await self.loop.call(lambda e: e.abort_request(request_id))
