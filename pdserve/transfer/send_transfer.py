"""The sender's side of one transfer: ``SendTransfer``, from ``KVTransport.start_send``.

It builds every message's header, sends each layer framed (``send_layer``: gathered blocks) or
from the pools (``send_pool_layer``: direct through the transport's ``DirectPath`` where it can,
else gathered into a message buffer first), tracks the sends' futures and sums up the stats.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve import kernels
from pdserve.transfer.direct import DirectPath, DirectPlan
from pdserve.transfer.errors import TransferTimeoutError
from pdserve.transfer.header import HEADER_NBYTES, LayerHeader, check_transfer_id
from pdserve.transfer.stats import WAIT_GRACE_S, TransferStats

if TYPE_CHECKING:
    from pdserve.transfer.base import KVTransport, PeerHandle


class SendTransfer:
    """Sender-side view of one transfer: builds headers, tracks sends, sums up stats.

    Used from one thread (the engine's); created by ``KVTransport.start_send``."""

    def __init__(
        self,
        transport: KVTransport,
        peer: PeerHandle,
        transfer_id: int,
        num_blocks: int,
        timeout: float,
        traceparent: str = "",
        device: str | torch.device = "cpu",
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        check_transfer_id(transfer_id)
        if dst_block_ids is not None and len(dst_block_ids) != num_blocks:
            raise ValueError(f"{len(dst_block_ids)} destination block ids for {num_blocks} blocks")
        self.dst_block_ids = None if dst_block_ids is None else [int(b) for b in dst_block_ids]
        self.device = torch.device(device)
        self.transport = transport
        self.peer = peer
        self.transfer_id = transfer_id
        self.num_blocks = num_blocks
        self.deadline = time.monotonic() + timeout
        self.traceparent = traceparent
        self._futures: list[concurrent.futures.Future[None]] = []
        self._nbytes = 0
        self._started: float | None = None
        self._finished = 0.0
        self._num_finished = 0
        self._lock = threading.Lock()
        # send_pool_layer's route, decided at its first call: direct (the path and its plan), or
        # framed (the kernels' gather of a layer's blocks into a message buffer on ``device``)
        self._route_decided = False
        self._direct: tuple[DirectPath, DirectPlan] | None = None
        self._gather = kernels.get_backend(self.device).gather_kv_blocks
        self._held_last: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer_buffers(self, num_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V tensors to gather a layer into, sent without a copy (see KVTransport)."""
        return self.transport.layer_buffers(num_blocks or self.num_blocks, self.device)

    def send_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        block_offset: int = 0,
        token_id: int = -1,
    ) -> concurrent.futures.Future[None]:
        """Push one layer's gathered blocks; returns once they are copied out, before delivery."""
        remaining = self._remaining(layer)
        if self._direct is not None:
            raise RuntimeError(f"transfer {self.transfer_id} is sent direct: use send_pool_layer")
        layout = self.transport.layout
        header = LayerHeader.for_layer(
            layout,
            self.transfer_id,
            layer,
            k.shape[0],
            block_offset=block_offset,
            token_id=token_id,
            traceparent=self.traceparent,
        )
        if self._started is None:
            self._started = time.perf_counter()
        fut = self.transport.send_layer(self.peer, header, k, v, timeout=remaining)
        self._track(fut, layout.message_nbytes(header.num_blocks))
        return fut

    def send_pool_layer(
        self, layer: int, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Send layer ``layer`` of the pools' blocks ``block_ids`` (int64, the same for every
        layer); the last layer goes with ``finish``, which adds the first token.

        Straight from the pools (no copy; ``direct.py``) when the destination's block ids were
        given to ``start_send`` and the transport's ``DirectPath`` takes the transfer, in which
        case the pools' blocks must stay unchanged until ``wait`` returns; else gathered into a
        message buffer first (a copy)."""
        if not self._route_decided:
            self._direct = self._start_direct(k_pool, v_pool, block_ids)
            self._route_decided = True
        if self._direct is not None:
            direct, plan = self._direct
            remaining = self._remaining(layer)
            futures = direct.send_layer(self.peer, plan, layer, k_pool, v_pool, remaining)
            for i, fut in enumerate(futures):  # the layer's bytes, counted once
                self._track(fut, plan.layer_nbytes if i == 0 else 0)
            return
        k, v = self.layer_buffers()
        self._gather(k_pool, v_pool, block_ids, k, v)
        if layer == self.transport.layout.num_layers - 1:
            self._held_last = (k, v)
        else:
            self.send_layer(layer, k, v)

    @property
    def direct(self) -> bool:
        """Whether ``send_pool_layer`` sends straight from the pools (decided at its first call)."""
        return self._direct is not None

    def finish(self, token_id: int = -1) -> None:
        """Send what is left after the last ``send_pool_layer``, with the first sampled token:
        the trailer of a direct transfer, else the held last layer."""
        last = self.transport.layout.num_layers - 1
        if self._direct is not None:
            direct, plan = self._direct
            header = LayerHeader.for_layer(
                self.transport.layout,
                self.transfer_id,
                last,
                self.num_blocks,
                token_id=token_id,
                traceparent=self.traceparent,
            )
            fut = direct.send_trailer(self.peer, plan, header, self._remaining(last))
            self._track(fut, HEADER_NBYTES)
        elif self._held_last is not None:
            (k, v), self._held_last = self._held_last, None
            self.send_layer(last, k, v, token_id=token_id)
        else:
            raise RuntimeError(f"transfer {self.transfer_id}: finish before the last layer")

    def _start_direct(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[DirectPath, DirectPlan] | None:
        """The transfer's direct path and plan (sent); None: it goes framed."""
        if self.dst_block_ids is None:
            return None
        src = [int(b) for b in block_ids.tolist()]
        if len(src) != self.num_blocks:
            raise ValueError(f"{len(src)} block ids for a transfer of {self.num_blocks} blocks")
        if self._started is None:
            self._started = time.perf_counter()
        direct = self.transport.direct
        if direct is None:
            return None
        made = direct.start(
            self.peer,
            self.transfer_id,
            src,
            self.dst_block_ids,
            k_pool,
            v_pool,
            self.traceparent,
            self._remaining(0),
        )
        if made is None:
            return None
        plan, fut = made
        self._track(fut, plan.plan_nbytes)
        return direct, plan

    def _remaining(self, layer: int) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(
                f"transfer {self.transfer_id}: deadline passed before layer {layer}"
            )
        return remaining

    def _track(self, fut: concurrent.futures.Future[None], nbytes: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()
        self._nbytes += nbytes
        fut.add_done_callback(self._record_finish)
        self._futures.append(fut)

    def _record_finish(self, _: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._finished = max(self._finished, time.perf_counter())
            self._num_finished += 1

    def wait(self) -> TransferStats:
        """Block until every send has been taken by the receiver; raise the first failure."""
        for fut in self._futures:
            remaining = self.deadline - time.monotonic() + WAIT_GRACE_S
            try:
                fut.result(timeout=max(remaining, 0.0))
            except concurrent.futures.TimeoutError:
                raise TransferTimeoutError(
                    f"transfer {self.transfer_id}: sends not completed by the deadline"
                ) from None
        now = time.perf_counter()
        started = self._started if self._started is not None else now
        with self._lock:  # a future's waiters wake before its callbacks run: count those as now
            finished = self._finished if self._num_finished == len(self._futures) else now
        return TransferStats(
            self.transfer_id,
            self.transport.layout.num_layers,
            len(self._futures),
            self._nbytes,
            max(finished - started, 0.0),
        )
