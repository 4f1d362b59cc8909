"""PrefillWorker: batched, chunked prefill whose KV is pushed layer by layer while the model runs.

In the engine thread, after layer i of a forward that completes a prompt, that prompt's blocks of
layer i are gathered (a copy) and handed to the transport, which sends them while layer i+1
computes. The last layer waits for sampling so that the first token rides in its header. The
prompt's own blocks are freed by the engine right after the step: the gathers have copied them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.engine import LLMEngine, RequestOutput
from pdserve.engine_loop import EngineLoop
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
    last_layer: tuple[torch.Tensor, torch.Tensor] | None = None
    error: BaseException | None = None
    first_send: float = 0.0  # perf_counter when layer 0 left
    compute_end: float = 0.0  # perf_counter when sampling ended (the last layer leaves then)


def overlap_fraction(send: _Send, seconds: float) -> float:
    """Share of the transfer's time during which the model was still computing."""
    if seconds <= 0 or not send.first_send:
        return 0.0
    return min(max((send.compute_end - send.first_send) / seconds, 0.0), 1.0)


class PrefillWorker:
    def __init__(self, engine: LLMEngine, transport: KVTransport) -> None:
        self.engine = engine
        self.transport = transport
        self.loop = EngineLoop(engine, on_layer=self._on_layer, after_step=self._after_step)
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

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      dest: Destination) -> tuple[RequestOutput, TransferStats, float]:
        """Prefill, ship the KV to ``dest``; returns the first token, the transfer's stats and the
        share of the transfer that overlapped the model's compute."""
        self.engine.validate(prompt_ids, params)
        num_prompt_blocks = -(-len(prompt_ids) // self.engine.scheduler.block_size)
        if len(dest.block_ids) != num_prompt_blocks:
            raise ValueError(f"destination has {len(dest.block_ids)} blocks; the prompt fills {num_prompt_blocks}")
        peer = await asyncio.to_thread(self._peer, dest.kv_address)
        tx = self.transport.start_send(peer, dest.transfer_id, num_prompt_blocks, dest.timeout_s)
        self._sends[request_id] = _Send(tx, num_prompt_blocks)
        q = self.loop.open_stream(request_id)
        done = False
        try:
            one = dataclasses.replace(params, max_tokens=1, stop=())
            await self.loop.call(lambda e: e.add_request(prompt_ids, one, request_id))
            out = await q.get()
            done = True
            send = self._sends[request_id]
            if send.error is not None:
                raise send.error
            stats = await asyncio.to_thread(tx.wait)
            return out, stats, overlap_fraction(send, stats.seconds)
        finally:
            self.loop.close_stream(request_id)
            self._sends.pop(request_id, None)
            if not done:
                await self.loop.call(lambda e: e.abort_request(request_id))

    # -- engine thread ------------------------------------------------------------------------

    def _on_layer(self, batch: ScheduledBatch, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        for seq, n in batch.prefills:
            send = self._sends.get(seq.request_id)
            if send is None or send.error is not None or seq.num_computed_tokens + n < seq.num_prompt_tokens:
                continue
            ids = torch.tensor(seq.block_table[: send.num_blocks], device=k_cache.device)
            # Gather straight into the transport's message buffers: sent without another copy.
            k, v = send.tx.layer_buffers()
            torch.index_select(k_cache, 0, ids, out=k)
            torch.index_select(v_cache, 0, ids, out=v)
            if layer == self._num_layers - 1:
                send.last_layer = (k, v)  # goes out with the first token, after sampling
                continue
            try:
                send.tx.send_layer(layer, k, v)
                if not send.first_send:
                    send.first_send = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - reported to the waiting request
                send.error = e

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            send = self._sends.get(out.request_id)
            if send is None or send.last_layer is None or send.error is not None:
                continue
            k, v = send.last_layer
            send.last_layer = None
            send.compute_end = time.perf_counter()
            try:
                send.tx.send_layer(self._num_layers - 1, k, v, token_id=out.new_token_ids[0])
            except Exception as e:  # noqa: BLE001
                send.error = e
