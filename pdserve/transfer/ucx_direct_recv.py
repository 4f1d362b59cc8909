"""Direct transfers over UCX, the receiver's part (plan.py; the sender's: ucx_direct_send.py).

When the transfer's destination is a ``PoolDestination`` of contiguous CPU pools and its block ids
fall into at most ``max_segments`` runs, every data message that a direct sender would send is
received from ``expect`` on, each straight into its run of the reserved blocks (*pre-posted*:
nothing waits for the plan, and the messages never queue as unexpected); the plan must then name
the same segments. Otherwise only the plan is waited for (beside the framed receives), and a
direct transfer lands in a message buffer per layer that then goes through the transfer like a
framed message. A layer counts as landed when its 2 x segments data messages have; the last one,
when the trailer (which carries the first token) has too.

Fencing (docs/architecture.md, "Fenced KV blocks"). A data message carries no header: what fences
it is its tag, which holds the transfer id, the generation of the reservation it was sent for.
Receives are posted only for a live reservation; when its transfer ends they are cancelled, and a
late message with that tag then matches nothing of the pools (the receiver drains and counts it,
ucx_recv.py). A receive that UCX had already matched cannot be cancelled: its data is still on
the way (measured: a sender stopped by SIGSTOP in the middle of a message writes the rest into the
posted buffer after SIGCONT, cancel or not). So ``cancel_all`` cancels every receive, and each one
that is not over at once holds the transfer's ``settled`` until it completes; the caller frees
the blocks on ``settled``, not after a fixed delay (the one bound: ``fence_timeout_s``, for a
sender that never finishes its message, fence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.transfer.errors import HeaderMismatchError, TransferError
from pdserve.transfer.header import HEADER_NBYTES, KVLayout, LayerHeader
from pdserve.transfer.plan import (
    TRAILER_SUB,
    message_tag,
    plan_nbytes,
    segment_bounds,
    sub_tag,
)
from pdserve.transfer.pool_copy import PoolDestination
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.ucx_buffers import Message, MessagePool, PoolBytes, pool_ok, ucx_array
from pdserve.transfer.ucx_runtime import UCXWorkerThread


class DirectReceive:
    """Receiver side of one direct transfer, on the UCX thread (see the module docstring)."""

    def __init__(
        self,
        ucx: UCXWorkerThread,
        transfer: RecvTransfer,
        starts: list[int],
        pools: PoolDestination | None,
        messages: MessagePool,
        pool_bytes: PoolBytes,
        error_of: Callable[[BaseException, int], TransferError],
    ) -> None:
        """Lands in ``pools`` (None: in message buffers from ``messages``, then through the
        transfer like framed messages); ``error_of(exc, layer)`` makes a failed receive's error."""
        self.ucx, self.layout, self.transfer = ucx, transfer.layout, transfer
        self.messages = messages
        self.pool_bytes = pool_bytes
        tid = transfer.transfer_id
        self.tag_of = lambda sub: ucx.tag(message_tag(tid, sub))
        self.error_of = error_of
        n = transfer.num_blocks
        self.starts = starts
        self.bounds = segment_bounds(starts, n)
        self.block_bytes = self.layout.block_nbytes()
        self.layer_nbytes = 2 * n * self.block_bytes
        self.plan_nbytes = plan_nbytes(len(starts))
        self.left = [2 * len(self.bounds)] * self.layout.num_layers
        self.pending: dict[int, tuple[Any, Any]] = {}  # sub-tag: (request, its buffer)
        self.trailer: LayerHeader | None = None
        self.trailer_buf = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
        self.staged: list[Message] | None = None
        self.pools = pools

    @staticmethod
    def lands(layout: KVLayout, pools: PoolDestination) -> bool:
        """Whether ``pools`` are ``layout``'s (contiguous CPU pools) and its ids lie inside them."""
        ids = pools.block_ids
        if len(pools.k_pools) != layout.num_layers or len(pools.v_pools) != layout.num_layers:
            return False
        if not pool_ok(layout, *pools.k_pools, *pools.v_pools):
            return False
        return 0 <= int(ids.min()) and int(ids.max()) < pools.k_pools[0].shape[0]

    def post_all(self) -> None:
        layout, pools = self.layout, self.pools
        num_layers, num_segments = layout.num_layers, len(self.bounds)
        bb = self.block_bytes
        ids = pools.block_ids.tolist() if pools is not None else None
        if pools is None:
            cpu = torch.device("cpu")
            self.staged = [
                self.messages.take(self.transfer.num_blocks, cpu) for _ in range(num_layers)
            ]
        for layer in range(num_layers):
            if pools is not None:
                targets = (
                    self.pool_bytes(pools.k_pools[layer]),
                    self.pool_bytes(pools.v_pools[layer]),
                )
            else:
                msg = self.staged[layer]  # type: ignore[index]
                targets = (
                    msg.k.view(-1).view(torch.uint8).numpy(),
                    msg.v.view(-1).view(torch.uint8).numpy(),
                )
            for kv, flat in enumerate(targets):
                for seg, (a, count) in enumerate(self.bounds):
                    start = (ids[a] if ids is not None else a) * bb
                    self._post(
                        sub_tag(num_layers, num_segments, layer, kv, seg),
                        layer,
                        flat[start : start + count * bb],
                    )
        self._post(TRAILER_SUB, -1, self.trailer_buf.numpy())

    def _post(self, sub: int, layer: int, view: Any) -> None:
        ucx = self.ucx
        array = ucx_array(view)
        request = ucx.worker.tag_recv(array, self.tag_of(sub), ucx.TAG_MASK_FULL)
        self.pending[sub] = (request, array)
        ucx.watch(request, lambda exc: self._done(sub, layer, exc))

    def _done(self, sub: int, layer: int, exc: BaseException | None) -> None:
        self.pending.pop(sub, None)
        transfer = self.transfer
        if transfer.over:
            return
        if exc is not None:
            transfer.fail(self.error_of(exc, layer))
            return
        if layer < 0:
            try:
                self.trailer = self._check_trailer()
            except HeaderMismatchError as err:
                transfer.fail(err)
                return
            layer = self.layout.num_layers - 1
        else:
            self.left[layer] -= 1
        if self.left[layer] == 0 and (
            self.trailer is not None or layer < self.layout.num_layers - 1
        ):
            self._landed(layer)

    def _check_trailer(self) -> LayerHeader:
        header = LayerHeader.unpack(memoryview(self.trailer_buf.numpy()))
        header.check(self.layout)
        tid, n = self.transfer.transfer_id, self.transfer.num_blocks
        if (header.transfer_id, header.layer, header.block_offset, header.num_blocks) != (
            tid,
            self.layout.num_layers - 1,
            0,
            n,
        ):
            raise HeaderMismatchError(
                f"transfer {tid}: trailer for transfer {header.transfer_id} layer {header.layer} "
                f"blocks [{header.block_offset}, {header.block_offset + header.num_blocks}); "
                f"expected the last layer's {n} blocks"
            )
        return header

    def _landed(self, layer: int) -> None:
        last = layer == self.layout.num_layers - 1
        if last:
            header = self.trailer
        else:
            header = LayerHeader.for_layer(
                self.layout, self.transfer.transfer_id, layer, self.transfer.num_blocks
            )
        nbytes = (
            self.layer_nbytes
            + (HEADER_NBYTES if last else 0)
            + (self.plan_nbytes if layer == 0 else 0)
        )
        messages = 2 * len(self.bounds) + (1 if last else 0) + (1 if layer == 0 else 0)
        if self.staged is None:
            self.transfer.landed(header, nbytes, messages)  # type: ignore[arg-type]
            return
        msg = self.staged[layer]
        msg.write_header(header)  # type: ignore[arg-type]
        self.transfer.deliver(msg.buf, layer, (msg.k, msg.v), msg.head, nbytes=nbytes)
        self.messages.give(msg)

    def cancel_all(self) -> int:
        """Cancel every receive still posted; returns how many could not be (matched: their data
        is on the way). Each of those into the pools holds the transfer's ``settled`` until it
        completes; a staged one keeps its message buffer (never reused) until then."""
        pending, self.pending = self.pending, {}
        transfer, stuck = self.transfer, 0
        for sub, (request, array) in pending.items():
            into_pools = self.pools is not None and sub != TRAILER_SUB
            release = transfer.release_settle if into_pools else None
            if not self.ucx.retire(request, array, self.staged, on_over=release):
                stuck += 1  # its completion is reported in a later pass, after this hold
                if into_pools:
                    transfer.hold_settle()
        return stuck
