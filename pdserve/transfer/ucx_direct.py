"""Direct transfers over UCX (plan.py): K and V sent from the sender's pools, landed in the
receiver's, with no gather and no scatter; the one copy left is UCX's (the rendezvous write).

Sender (``DirectMixin.plan_direct``/``send_direct``/``send_trailer``): the plan, then per layer
2 x segments tagged messages, then the trailer. A segment whose source ids are consecutive is
sent from a view of the pool (ucxx reads it through numpy, no copy); one whose source ids are not
is gathered into a buffer of its own first. The caller keeps the blocks unchanged until the
transfer's sends have completed.

Receiver (``DirectReceive``). When the transfer's ``on_layer`` is ``scatter_into``'s
(``base.Landing``) and its block ids fall into at most ``max_segments`` runs, every data message
that a direct sender would send is received from ``expect`` on, each straight into its run of the
reserved blocks (*pre-posted*: nothing waits for the plan, and the messages never queue as
unexpected); the plan must then name the same segments. Otherwise only the plan is waited for
(beside the framed receives), and a direct transfer lands in a message buffer per layer that then
goes to ``on_layer`` like a framed message. A layer counts as landed when its 2 x segments data
messages have; the last one, when the trailer (which carries the first token) has too.

Cancelling. A receive that UCX has matched to a message cannot be cancelled: the sender may be
writing into it. A failed transfer that lands in the pools therefore fails its future (on which
the caller frees the blocks) ``SETTLE_S`` after its receives were cancelled, time for a write
already under way to finish. A sender that stops for longer in the middle of a write (SIGSTOP)
could still write into blocks freed meanwhile; one that dies cannot.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy
import torch

from pdserve.kernels.cpu import block_copy
from pdserve.transfer.base import Landing, PeerHandle, RecvTransfer
from pdserve.transfer.errors import HeaderMismatchError
from pdserve.transfer.header import HEADER_NBYTES, KVLayout, LayerHeader
from pdserve.transfer.plan import (
    PLAN_SUB,
    TRAILER_SUB,
    fits_tags,
    message_tag,
    pack_plan,
    plan_nbytes,
    segment_bounds,
    segment_starts,
    sub_tag,
    unpack_plan,
)
from pdserve.transfer.transfers import DirectPlan, SendTransfer
from pdserve.transfer.ucx_buffers import Message, MessagePool, RawBuffer, ucx_array

SETTLE_S = 0.2
MAX_CACHED_POOLS = 1024


def pool_ok(layout: KVLayout, *pools: torch.Tensor) -> bool:
    """Whether ``pools`` are contiguous CPU pools of ``layout``'s blocks, all of one size."""
    first = pools[0]
    return all(
        p.device.type == "cpu"
        and p.is_contiguous()
        and p.dtype == layout.dtype
        and p.dim() == 4
        and tuple(p.shape[1:]) == layout.block_shape
        and p.shape[0] == first.shape[0]
        for p in pools
    )


class PoolBytes:
    """Each pool's memory as one flat numpy uint8 array, made once per pool."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}

    def __call__(self, pool: torch.Tensor) -> Any:
        key = (pool.data_ptr(), pool.numel())
        hit = self._made.get(key)
        if hit is None:
            if len(self._made) >= MAX_CACHED_POOLS:
                self._made.clear()
            hit = self._made[key] = (pool, pool.view(-1).view(torch.uint8).numpy())
        return hit[1]


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


def direct_starts(layout: KVLayout, dst: list[int], max_segments: int) -> list[int] | None:
    """The segments of a transfer into blocks ``dst`` (its runs), if it goes direct."""
    starts = segment_starts(dst)
    if len(starts) > max_segments or not fits_tags(layout.num_layers, len(starts)):
        return None
    return starts


class DirectReceive:
    """Receiver side of one direct transfer, on the UCX thread (see the module docstring)."""

    def __init__(
        self, transport: Any, transfer: RecvTransfer, starts: list[int], landing: Landing | None
    ) -> None:
        self.ucx, self.layout, self.transfer = transport._ucx, transport.layout, transfer
        self.messages: MessagePool = transport._messages
        self.pool_bytes: PoolBytes = transport._pool_bytes
        tid = transfer.transfer_id
        self.tag_of = lambda sub: transport._ucx.tag(message_tag(tid, sub))
        self.error_of = lambda exc, layer: transport._recv_error(exc, transfer, layer)
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
        self.landing = landing

    @staticmethod
    def lands(layout: KVLayout, landing: Landing, num_blocks: int) -> bool:
        """Whether ``landing``'s pools are ``layout``'s and its ids lie inside them."""
        ids = landing.block_ids
        if ids.numel() != num_blocks or len(landing.k_pools) != layout.num_layers:
            return False
        if len(landing.v_pools) != layout.num_layers:
            return False
        if not pool_ok(layout, *landing.k_pools, *landing.v_pools):
            return False
        return 0 <= int(ids.min()) and int(ids.max()) < landing.k_pools[0].shape[0]

    def post_all(self) -> None:
        layout, landing = self.layout, self.landing
        num_layers, num_segments = layout.num_layers, len(self.bounds)
        bb = self.block_bytes
        ids = landing.block_ids.tolist() if landing is not None else None
        if landing is None:
            cpu = torch.device("cpu")
            self.staged = [
                self.messages.take(self.transfer.num_blocks, cpu) for _ in range(num_layers)
            ]
        for layer in range(num_layers):
            if landing is not None:
                targets = (
                    self.pool_bytes(landing.k_pools[layer]),
                    self.pool_bytes(landing.v_pools[layer]),
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

    def cancel_all(self) -> bool:
        """Cancel every receive still posted; whether any of them was into the pools."""
        pending, self.pending = self.pending, {}
        for request, array in pending.values():
            self.ucx.forget(request, array)
        return self.landing is not None and len(pending) > (1 if TRAILER_SUB in pending else 0)


class DirectMixin:
    """UCXTransport's direct paths (its attributes are used as they are there)."""

    _ucx: Any
    _messages: MessagePool
    _pool_bytes: PoolBytes
    layout: KVLayout
    max_segments: int

    # -- receiver -----------------------------------------------------------------------------

    def _pre_post(self, rec: Any) -> None:
        """From ``expect``: receive a direct transfer straight into the pools if it can be."""
        transfer = rec.transfer
        landing = getattr(transfer.on_layer, "landing", None)
        if landing is None or self.max_segments < 1:
            return
        starts = direct_starts(self.layout, landing.block_ids.tolist(), self.max_segments)
        if starts is None or not DirectReceive.lands(self.layout, landing, transfer.num_blocks):
            return
        rec.direct = DirectReceive(self, transfer, starts, landing)
        rec.direct.post_all()

    def _plan_done(self, rec: Any, exc: BaseException | None) -> None:
        """The sender sends this transfer direct."""
        if rec.plan is None or rec.transfer.over:  # over (and forgotten) in this same reap
            rec.plan = None
            return
        transfer, (_, buf) = rec.transfer, rec.plan
        rec.plan = None
        if exc is not None:
            transfer.fail(self._recv_error(exc, transfer, 0))  # type: ignore[attr-defined]
            return
        tid = transfer.transfer_id
        try:
            header, starts = unpack_plan(
                memoryview(buf.numpy()), self.layout, tid, transfer.num_blocks
            )
            if rec.framed_seen:
                raise HeaderMismatchError(f"transfer {tid}: a plan after framed messages")
            if rec.direct is not None and starts != rec.direct.starts:
                raise HeaderMismatchError(
                    f"transfer {tid}: plan's segments {starts} are not the runs of the reserved "
                    f"blocks {rec.direct.starts}: the sender has other destination ids"
                )
        except HeaderMismatchError as err:
            transfer.fail(err)
            return
        if header.traceparent:
            transfer.traceparent = header.traceparent
        self._drop_framed(rec)  # type: ignore[attr-defined]
        if rec.direct is None:
            rec.direct = DirectReceive(self, transfer, starts, None)
            rec.direct.post_all()

    # -- sender -------------------------------------------------------------------------------

    def plan_direct(
        self,
        tx: SendTransfer,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        src_block_ids: list[int],
        timeout: float,
    ) -> tuple[DirectPlan, concurrent.futures.Future[None]] | None:
        if (
            tx.dst_block_ids is None
            or self.max_segments < 1
            or not pool_ok(self.layout, k_pool, v_pool)
            or not all(0 <= b < k_pool.shape[0] for b in src_block_ids)
        ):
            return None
        starts = direct_starts(self.layout, tx.dst_block_ids, self.max_segments)
        if starts is None:
            return None
        peer = self._as_peer(tx.peer)  # type: ignore[attr-defined]
        plan = DirectPlanUCX(self.layout, tx.transfer_id, src_block_ids, starts, tx.traceparent)
        return plan, self._send_small(peer, plan.message, tx.transfer_id, PLAN_SUB, timeout)

    def send_direct(
        self,
        peer: PeerHandle,
        plan: DirectPlan,
        layer: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        timeout: float,
    ) -> list[concurrent.futures.Future[None]]:
        if not isinstance(plan, DirectPlanUCX):
            raise TypeError("plan must come from this transport's plan_direct")
        ucx_peer = self._as_peer(peer)  # type: ignore[attr-defined]
        if not 0 <= layer < plan.num_layers:
            raise ValueError(f"layer {layer} out of range for {plan.num_layers} layers")
        if not pool_ok(self.layout, k_pool, v_pool):
            raise ValueError("k_pool and v_pool must be contiguous CPU pools of this KV layout")
        deadline = time.monotonic() + timeout
        where = f"transfer {plan.transfer_id} layer {layer}"
        tid, num_layers, num_segments = plan.transfer_id, plan.num_layers, plan.num_segments
        enqueue = self._enqueue  # type: ignore[attr-defined]
        futures = []
        for kv, pool in enumerate((k_pool, v_pool)):
            flat = self._pool_bytes(pool)
            for seg, source in enumerate(plan.sources):
                if isinstance(source, tuple):
                    start, nbytes = source
                    keep: Any = pool
                    view = flat[start : start + nbytes]
                else:  # source ids not consecutive: gathered (one copy, on this side only)
                    keep = block_copy.gather_blocks(pool, source)
                    view = keep.view(-1).view(torch.uint8).numpy()
                tag = message_tag(tid, sub_tag(num_layers, num_segments, layer, kv, seg))
                futures.append(
                    enqueue(ucx_peer, tag, RawBuffer(keep, ucx_array(view)), deadline, where)
                )
        return futures

    def send_trailer(
        self, peer: PeerHandle, header: LayerHeader, timeout: float
    ) -> concurrent.futures.Future[None]:
        ucx_peer = self._as_peer(peer)  # type: ignore[attr-defined]
        return self._send_small(ucx_peer, header.pack(), header.transfer_id, TRAILER_SUB, timeout)

    def _send_small(
        self, peer: Any, data: bytes, tid: int, sub: int, timeout: float
    ) -> concurrent.futures.Future[None]:
        buf = numpy.frombuffer(data, dtype=numpy.uint8)
        where = f"transfer {tid} {'plan' if sub == PLAN_SUB else 'trailer'}"
        msg = RawBuffer(buf, ucx_array(buf))
        return self._enqueue(peer, message_tag(tid, sub), msg, time.monotonic() + timeout, where)  # type: ignore[attr-defined]
