"""Direct transfers over UCX, the sender's part (plan.py; the receiver's: ucx_direct_recv.py).

``UCXDirectPath`` is the UCX transport's ``DirectPath`` (direct.py): the plan, then per layer
2 x segments tagged messages, then the trailer, all through the transport's ``UCXSender``. A
segment whose source ids are consecutive is sent from a view of the pool (ucxx reads it through
numpy, no copy); one whose source ids are not is gathered into a buffer of its own first (the
kernels' ``gather_blocks``). The caller keeps the blocks unchanged until the transfer's sends
have completed.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdserve import kernels
from pdserve.transfer.base import PeerHandle
from pdserve.transfer.direct import DirectPath, DirectPlan
from pdserve.transfer.header import KVLayout, LayerHeader
from pdserve.transfer.liveness import stamp_sender
from pdserve.transfer.plan import (
    PLAN_SUB,
    TRAILER_SUB,
    direct_starts,
    message_tag,
    pack_plan,
    segment_bounds,
    sub_tag,
)
from pdserve.transfer.ucx_buffers import PoolBytes, RawBuffer, pool_ok, ucx_array
from pdserve.transfer.ucx_send import UCXSender


class DirectPlanUCX(DirectPlan):
    """The sender's plan: per segment, its source's byte offset in the pools (a run of blocks)
    or, where the source ids are not consecutive, those ids (gathered first)."""

    def __init__(
        self,
        layout: KVLayout,
        transfer_id: int,
        src: list[int],
        starts: list[int],
        traceparent: str,
    ) -> None:
        block_bytes = layout.block_nbytes()
        num_blocks = len(src)
        self.transfer_id = transfer_id
        self.num_layers = layout.num_layers
        self.num_segments = len(starts)
        self.sources: list[tuple[int, int] | torch.Tensor] = []
        for a, n in segment_bounds(starts, num_blocks):
            run = src[a : a + n]
            if run[-1] - run[0] == n - 1 and all(run[i] == run[i - 1] + 1 for i in range(1, n)):
                self.sources.append((run[0] * block_bytes, n * block_bytes))
            else:
                self.sources.append(torch.tensor(run, dtype=torch.int64))
        header = LayerHeader.for_layer(layout, transfer_id, 0, num_blocks, traceparent=traceparent)
        self.message = pack_plan(header, starts)
        self.plan_nbytes = len(self.message)
        self.layer_nbytes = 2 * num_blocks * block_bytes


class UCXDirectPath(DirectPath):
    """Sends direct transfers of up to ``max_segments`` segments through ``sender``."""

    def __init__(
        self, sender: UCXSender, layout: KVLayout, pool_bytes: PoolBytes, max_segments: int
    ) -> None:
        self.sender = sender
        self.layout = layout
        self.max_segments = max_segments
        self._pool_bytes = pool_bytes

    def start(
        self,
        peer: PeerHandle,
        transfer_id: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        traceparent: str,
        timeout: float,
    ) -> tuple[DirectPlan, concurrent.futures.Future[None]] | None:
        if not pool_ok(self.layout, k_pool, v_pool) or not all(
            0 <= b < k_pool.shape[0] for b in src_block_ids
        ):
            return None
        starts = direct_starts(self.layout, dst_block_ids, self.max_segments)
        if starts is None:
            return None
        ucx_peer = self.sender.as_peer(peer)
        plan = DirectPlanUCX(self.layout, transfer_id, list(src_block_ids), starts, traceparent)
        message = stamp_sender(plan.message, self.sender.links.sender_id)  # liveness.py
        return plan, self.sender.send_small(ucx_peer, message, transfer_id, PLAN_SUB, timeout)

    def send_layer(
        self,
        peer: PeerHandle,
        plan: DirectPlan,
        layer: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        timeout: float,
    ) -> list[concurrent.futures.Future[None]]:
        if not isinstance(plan, DirectPlanUCX):
            raise TypeError("plan must come from this transport's direct path")
        ucx_peer = self.sender.as_peer(peer)
        if not 0 <= layer < plan.num_layers:
            raise ValueError(f"layer {layer} out of range for {plan.num_layers} layers")
        if not pool_ok(self.layout, k_pool, v_pool):
            raise ValueError("k_pool and v_pool must be contiguous CPU pools of this KV layout")
        deadline = time.monotonic() + timeout
        where = f"transfer {plan.transfer_id} layer {layer}"
        tid, num_layers, num_segments = plan.transfer_id, plan.num_layers, plan.num_segments
        enqueue = self.sender.enqueue
        futures = []
        for kv, pool in enumerate((k_pool, v_pool)):
            flat = self._pool_bytes(pool)
            for seg, source in enumerate(plan.sources):
                if isinstance(source, tuple):
                    start, nbytes = source
                    keep: Any = pool
                    view = flat[start : start + nbytes]
                else:  # source ids not consecutive: gathered (one copy, on this side only)
                    keep = kernels.get_backend(pool.device).gather_blocks(pool, source)
                    view = keep.view(-1).view(torch.uint8).numpy()
                tag = message_tag(tid, sub_tag(num_layers, num_segments, layer, kv, seg))
                futures.append(
                    enqueue(ucx_peer, tag, RawBuffer(keep, ucx_array(view)), deadline, where)
                )
        return futures

    def send_trailer(
        self, peer: PeerHandle, plan: DirectPlan, header: LayerHeader, timeout: float
    ) -> concurrent.futures.Future[None]:
        ucx_peer = self.sender.as_peer(peer)
        tid = header.transfer_id
        return self.sender.send_small(ucx_peer, header.pack(), tid, TRAILER_SUB, timeout)
