"""The engine's KV connector: the few calls through which a request's KV leaves or enters an engine.

The engine owns its blocks; the services own the transport. Between them, per role:

    prefill engine (PrefillConnector)              decode engine
    add_prefill(ids, params, rid, sender,          reserve_request(ids, params, rid) -> KVLanding
                skip_blocks=landing's                (shares the prompt's leading blocks found
                num_cached_blocks)                   in its prefix cache, num_cached_blocks;
      -> OutgoingKV (the service reads it after      the service has the transport land the
         the request's output arrived)               rest of the prompt's KV in block_ids)
    step():                                        activate_request(rid, first token)
      after layer i of the forward that completes  abort_request(rid): frees the reservation
      a prompt     -> on_layer: sender.send_pool_layer(i, pools, blocks)
      after sampling -> end_step: sender.finish(first token)
      request ends -> request_finished: HeldBlocks if the sender still reads the pools
                                                   hold_landing(rid) before abort_request: the
                                                     failed transfer has not settled (a write
                                                     may still land): HeldBlocks
    release_held(rid): the transfer is over (settled), the held blocks are freed

Ownership is in the types: a ``KVLanding``'s blocks belong to the engine's reservation until
``activate_request``/``abort_request``; its ``generation`` is the transfer id that every KV
message for it carries (transfer/fence.py). ``HeldBlocks`` are blocks a finished request leaves
allocated because a transfer still reads them (prefill) or may still write them (decode), freed
only by ``LLMEngine.release_held``. Every call here runs in the engine thread (between or inside
steps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pdserve.scheduler import ScheduledBatch
    from pdserve.sequence import Sequence as Seq


class KVSender(Protocol):
    """One prompt's outgoing KV, as the connector drives it (a transfer's ``SendTransfer``)."""

    num_blocks: int  # the prompt's blocks, as many as its receiver reserved

    @property
    def direct(self) -> bool:
        """Whether ``send_pool_layer`` reads the pools after it returned (then their blocks must
        stay allocated until the transfer is over)."""
        ...

    def send_pool_layer(
        self, layer: int, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Send layer ``layer`` of the pools' blocks ``block_ids`` (int64); returns at once."""
        ...

    def finish(self, token_id: int = -1) -> None:
        """Send what is left after the last layer, with the first sampled token."""
        ...


@dataclass(frozen=True)
class KVLanding:
    """Where a reserved request's prompt KV must land: blocks ``block_ids`` (in prompt order) of
    every layer's K and V pool. The blocks belong to the reservation until the request is
    activated or aborted; nothing else writes them meanwhile."""

    request_id: str
    block_ids: tuple[int, ...]
    k_pools: tuple[torch.Tensor, ...]
    v_pools: tuple[torch.Tensor, ...]
    generation: int = 0  # the allocator's, of these blocks: never reused (allocator.py)
    # the prompt's leading blocks shared from the engine's prefix cache, before ``block_ids``:
    # their KV is there already, so the sender skips them (and nothing writes them)
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class HeldBlocks:
    """Blocks a finished (or aborted) request left allocated because its transfer still reads
    them: freed by ``LLMEngine.release_held(request_id)`` once the transfer is over."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(eq=False)
class OutgoingKV:
    """The engine's record of one prompt's KV on its way out. Stamped in the engine thread; the
    service reads it once the request's output has arrived (its queue orders the two)."""

    request_id: str
    sender: KVSender
    submitted: float  # perf_counter when added
    scheduled: float = 0.0  # when its first forward had run layer 0
    batch_size: int = 0  # prompts in that forward
    first_send: float = 0.0  # when layer 0 left
    compute_end: float = 0.0  # when sampling ended (the first token left with finish)
    error: BaseException | None = None  # the sender's, reported to the waiting request
    skip_blocks: int = 0  # the prompt's leading blocks its destination holds already: not sent
    _block_ids: torch.Tensor | None = None  # the prompt's blocks sent, in the pools, int64

    def overlap_fraction(self, seconds: float) -> float:
        """Share of a transfer of ``seconds`` during which the model was still computing."""
        if seconds <= 0 or not self.first_send:
            return 0.0
        return min(max((self.compute_end - self.first_send) / seconds, 0.0), 1.0)


class PrefillConnector:
    """Ships each prompt's KV as the forward computes it: a layer leaves while the next one
    computes, the first token after sampling. Engine-facing calls: ``on_layer``, ``end_step``,
    ``request_finished``; the engine's ``add_prefill`` calls ``add``."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._out: dict[str, OutgoingKV] = {}

    def __bool__(self) -> bool:
        return bool(self._out)

    def add(self, request_id: str, sender: KVSender, skip_blocks: int = 0) -> OutgoingKV:
        out = OutgoingKV(request_id, sender, time.perf_counter(), skip_blocks=skip_blocks)
        self._out[request_id] = out
        return out

    def on_layer(
        self, batch: ScheduledBatch, layer: int, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> None:
        """After ``layer`` of a forward has written its KV: send it for every prompt that this
        forward completes (a prompt's KV is final only then: chunked prefill writes it piecewise)."""
        for seq, n in batch.prefills:
            out = self._out.get(seq.request_id)
            if out is None:
                continue
            if not out.scheduled:
                out.scheduled, out.batch_size = time.perf_counter(), len(batch.prefills)
            if out.error is not None or seq.num_computed_tokens + n < seq.num_prompt_tokens:
                continue
            if out._block_ids is None:  # the same blocks for every layer
                ids = _sent_blocks(seq, out)
                out._block_ids = torch.tensor(ids, dtype=torch.long, device=k_pool.device)
            try:
                out.sender.send_pool_layer(layer, k_pool, v_pool, out._block_ids)
            except Exception as e:  # noqa: BLE001 - reported to the waiting request
                out.error = e
                continue
            if not out.first_send:
                out.first_send = time.perf_counter()

    def end_step(self, seqs: Sequence[Seq], tokens: Sequence[int]) -> None:
        """After sampling: the first token of each prompt whose every layer left goes with
        ``finish`` (a direct transfer's trailer, or the held last layer of a framed one)."""
        for seq, token in zip(seqs, tokens, strict=True):
            out = self._out.get(seq.request_id)
            if out is None or not out.first_send or out.error is not None or out.compute_end:
                continue
            out.compute_end = time.perf_counter()
            try:
                out.sender.finish(token_id=token)
            except Exception as e:  # noqa: BLE001
                out.error = e

    def request_finished(self, seq: Seq) -> HeldBlocks | None:
        """The request ends (finished or aborted) and its blocks are about to be freed: the ones
        its sender still reads (a direct transfer under way), to keep allocated, or None."""
        out = self._out.pop(seq.request_id, None)
        if out is None or not out.sender.direct:  # decided at its first send_pool_layer
            return None
        return HeldBlocks(seq.request_id, tuple(_sent_blocks(seq, out)))


def _sent_blocks(seq: Seq, out: OutgoingKV) -> list[int]:
    """The prompt's blocks that ``out`` sends: those after the ones its destination holds."""
    return seq.block_table[out.skip_blocks : out.skip_blocks + out.sender.num_blocks]
