"""The UCX transport's receiving half: every transfer expected, its receives, and the drain of
late messages of failed ones. All of it runs on the UCX worker thread except ``expect``.

A transfer may come framed or direct (ucx.py), and the receiver does not know which until the
first message of one kind arrives, so ``expect`` posts both: a window of ``recv_window`` framed
layer receives, each into a message buffer of its own, and the plan's receive. For a
``PoolDestination`` whose blocks fall into few runs it also posts every receive of a direct
transfer at once, straight into the pools (ucx_direct_recv.py). The first framed message cancels
the direct receives, the plan cancels the framed ones (none of them can have matched: their tags
differ). Messages beyond the window, or for transfers not expected yet, wait in UCX's unexpected
queue.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.transfer.errors import HeaderMismatchError, PeerUnreachableError, TransferError
from pdserve.transfer.fence import BlockFence
from pdserve.transfer.header import KVLayout
from pdserve.transfer.liveness import GONE_GRACE_S, LivenessListener, read_sender
from pdserve.transfer.plan import (
    PLAN_NBYTES,
    PLAN_SUB,
    SUB_BITS,
    direct_starts,
    message_tag,
    unpack_plan,
)
from pdserve.transfer.pool_copy import KVDestination, PoolDestination
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.ucx_buffers import Message, MessagePool, PoolBytes
from pdserve.transfer.ucx_direct_recv import DirectReceive
from pdserve.transfer.ucx_runtime import UCXWorkerThread, call_or_closed, call_soon_or_closed

ANY_LAYER_MASK = ((1 << 64) - 1) ^ ((1 << SUB_BITS) - 1)


@dataclass(eq=False)
class _Recv:
    """A transfer being received: framed slots until a plan says it comes direct."""

    transfer: RecvTransfer
    slots: list[_Slot]
    plan: tuple[Any, torch.Tensor] | None = None  # the plan's receive and buffer, while posted
    direct: DirectReceive | None = None
    framed_seen: bool = False
    sender: bytes | None = None  # the sender's id (liveness.py), from the plan


@dataclass(eq=False)
class _Slot:
    """One receive buffer of a transfer, for layers slot, slot + window, ..."""

    layer: int
    msg: Message
    request: Any = None


class UCXReceiver:
    """Receives the transfers a worker expects; ``expect`` is safe from any thread."""

    def __init__(
        self,
        ucx: UCXWorkerThread,
        layout: KVLayout,
        messages: MessagePool,
        pool_bytes: PoolBytes,
        *,
        device: torch.device,
        recv_window: int,
        drain_seconds: float,
        max_segments: int,
        fence: BlockFence,
        fence_timeout_s: float | None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.recv_window = recv_window
        self.drain_seconds = drain_seconds
        self.max_segments = max_segments  # landed direct in the pools up to this many segments
        self.closed = False
        self.fence = fence
        self.fence_timeout_s = fence_timeout_s
        self._ucx = ucx
        self._messages = messages
        self._pool_bytes = pool_bytes
        self._recvs: dict[int, _Recv] = {}
        self._draining: dict[int, _Slot] = {}
        # The unsettled failed transfers of senders not known to be gone (liveness.py)
        self._held: dict[bytes, list[RecvTransfer]] = {}
        self.liveness: LivenessListener | None = None  # UCXTransport's

    def expect(self, transfer_id: int, destination: KVDestination, timeout: float) -> RecvTransfer:
        transfer = RecvTransfer(self.layout, transfer_id, destination, timeout, self._ucx)
        self.fence.claim(transfer)
        try:
            call_or_closed(self._ucx, self._start_recv, transfer)
        except BaseException:
            self.fence.release(transfer)
            raise
        return transfer

    # -- worker thread ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail every transfer under way and stop draining (the transport closes)."""
        self.closed = True
        for rec in list(self._recvs.values()):
            tid = rec.transfer.transfer_id
            rec.transfer.fail(TransferError(f"transfer {tid}: transport closed"))
        for tid in list(self._draining):
            self._stop_drain(tid)

    def _start_recv(self, transfer: RecvTransfer) -> None:
        tid = transfer.transfer_id
        if self.closed:
            raise TransferError("transport closed")
        if tid in self._recvs or tid in self._draining:
            raise ValueError(f"transfer id {tid} is in use (or was, less than a drain period ago)")
        window = min(self.recv_window, transfer.num_layers)
        slots = [
            _Slot(layer, self._messages.take(transfer.num_blocks, self.device))
            for layer in range(window)
        ]
        rec = self._recvs[tid] = _Recv(transfer, slots)
        transfer.start(self._recv_finished)
        self._pre_post(rec)
        ucx = self._ucx
        plan_buf = torch.empty(PLAN_NBYTES, dtype=torch.uint8)
        request = ucx.worker.tag_recv(
            ucx.array(plan_buf), ucx.tag(message_tag(tid, PLAN_SUB)), ucx.TAG_MASK_FULL
        )
        rec.plan = (request, plan_buf)
        ucx.watch(request, lambda exc: self._plan_done(rec, exc))
        for slot in slots:
            self._post_recv(transfer, slot)

    def _post_recv(self, transfer: RecvTransfer, slot: _Slot) -> None:
        ucx = self._ucx
        msg = slot.msg
        if msg.array is None:
            msg.array = ucx.array(msg.buf)
        tag = ucx.tag(message_tag(transfer.transfer_id, slot.layer))
        slot.request = ucx.worker.tag_recv(msg.array, tag, ucx.TAG_MASK_FULL)
        ucx.watch(slot.request, lambda exc: self._recv_done(transfer, slot, exc))

    def _recv_done(self, transfer: RecvTransfer, slot: _Slot, exc: BaseException | None) -> None:
        slot.request = None
        if exc is not None:
            transfer.fail(self._recv_error(exc, transfer, slot.layer))
            return
        rec = self._recvs.get(transfer.transfer_id)
        if rec is not None and not rec.framed_seen:  # sent framed: no direct message will come
            rec.framed_seen = True
            if rec.direct is not None:
                rec.direct.cancel_all()
                rec.direct = None
        msg = slot.msg
        transfer.deliver(msg.buf, slot.layer, (msg.k, msg.v), msg.head)
        if transfer.over:
            return
        if transfer.layer_complete(slot.layer):
            slot.layer += min(self.recv_window, transfer.num_layers)
        if slot.layer < transfer.num_layers:
            self._post_recv(transfer, slot)  # the next layer, or the next chunk of this one
        else:
            self._messages.give(msg)

    def _drop_framed(self, rec: _Recv) -> None:
        """The transfer comes direct: cancel the framed receives (none matched)."""
        for slot in rec.slots:
            if slot.request is not None:
                over = self._ucx.retire(slot.request, slot.msg)
                slot.request = None
                if not over:  # matched after all: the buffer is UCX's until it completes
                    continue
            self._messages.give(slot.msg)
        rec.slots = []

    def _recv_error(self, exc: BaseException, transfer: RecvTransfer, layer: int) -> TransferError:
        where = f"transfer {transfer.transfer_id} layer {layer}"
        if isinstance(exc, self._ucx.ucx.UCXMessageTruncatedError):
            nbytes = self.layout.message_nbytes(transfer.num_blocks)
            return HeaderMismatchError(
                f"{where}: message larger than the {nbytes} bytes of the reserved blocks: "
                "the sender's block count or KV layout differs"
            )
        err = PeerUnreachableError(f"{where}: receive failed ({exc}); the sender may have died")
        err.__cause__ = exc
        return err

    def _recv_finished(self, transfer: RecvTransfer) -> None:
        rec = self._recvs.pop(transfer.transfer_id, None)
        if rec is None:
            return
        if rec.plan is not None:
            self._ucx.retire(*rec.plan)
            rec.plan = None
        if rec.direct is not None:  # a receive it cannot cancel holds transfer.settled
            rec.direct.cancel_all()
            if transfer.unsettled:
                self._hold(transfer, rec.sender)
        for slot in rec.slots:
            if slot.request is not None:  # still posted: cancel it (its buffer is not reused)
                self._ucx.retire(slot.request, slot.msg)
                slot.request = None
            elif slot.layer < transfer.num_layers:
                self._messages.give(slot.msg)
        exc = transfer.error
        if exc is not None and not isinstance(exc, PeerUnreachableError):  # not from a dead one
            if not self.closed and self.drain_seconds > 0:
                self._start_drain(transfer)

    def _hold(self, transfer: RecvTransfer, sender: bytes | None) -> None:
        """``transfer`` failed with a receive into its blocks under way: they stay fenced until
        that receive ends; or, from a sender with a liveness connection open, until that sender
        is gone (plus a grace); or else until ``fence_timeout_s`` (liveness.py). ``alive`` is
        asked before ``gone``: the listener records a sender gone before it stops counting it
        alive, and its notice (``sender_gone``) may not have reached this thread yet."""
        live = self.liveness
        if sender is None or live is None:  # no word on its sender: a timeout is all there is
            self._give_up(transfer, time.monotonic(), False)
        elif live.alive(sender):
            self._keep(sender, transfer)  # no timeout: a stopped sender keeps its blocks
        elif (gone := live.gone(sender)) is not None:
            self._give_up(transfer, *gone)
        else:  # not heard from yet (its id may still be on its way): whichever comes first
            self._keep(sender, transfer)
            self._give_up(transfer, time.monotonic(), False)

    def _keep(self, sender: bytes, transfer: RecvTransfer) -> None:
        held = self._held.setdefault(sender, [])
        held[:] = [t for t in held if t.unsettled]
        held.append(transfer)

    def _give_up(self, transfer: RecvTransfer, since: float, proven: bool) -> None:
        """Settle ``transfer`` a grace after its sender was proven gone, or ``fence_timeout_s``
        after there was no more word from it (never, if None)."""
        if proven:
            self._ucx.call_at(since + GONE_GRACE_S, self.fence.expire, transfer)
        elif self.fence_timeout_s is not None:
            self._ucx.call_at(since + self.fence_timeout_s, self.fence.expire, transfer)

    def sender_gone(self, sender: bytes, proven: bool) -> None:
        """From the liveness listener's thread: ``sender``'s last connection ended."""
        with contextlib.suppress(TransferError):  # closed: nothing is held any more
            call_soon_or_closed(self._ucx, self._sender_gone, sender, proven)

    def _sender_gone(self, sender: bytes, proven: bool) -> None:
        now = time.monotonic()
        for transfer in self._held.pop(sender, []):
            if transfer.unsettled:
                self._give_up(transfer, now, proven)

    def _start_drain(self, transfer: RecvTransfer) -> None:
        """Take and drop late messages of a failed transfer, so that their senders complete."""
        tid = transfer.transfer_id
        slot = _Slot(0, self._messages.take(transfer.num_blocks, self.device))
        self._draining[tid] = slot
        # a live sender sends nothing after its deadline, which is at most the transfer's
        until = max(time.monotonic(), transfer.deadline) + self.drain_seconds
        self._ucx.call_at(until, self._stop_drain, tid)
        self._post_drain(tid, slot)

    def _post_drain(self, tid: int, slot: _Slot) -> None:
        ucx = self._ucx
        tag, mask = ucx.tag(message_tag(tid, 0)), ucx.tag_mask(ANY_LAYER_MASK)
        if slot.msg.array is None:
            slot.msg.array = ucx.array(slot.msg.buf)
        slot.request = ucx.worker.tag_recv(slot.msg.array, tag, mask)
        ucx.watch(slot.request, lambda exc: self._drained(tid, slot))

    def _drained(self, tid: int, slot: _Slot) -> None:
        slot.request = None
        self.fence.count_stale()  # late: its reservation is over (fenced off)
        if self._draining.get(tid) is slot:
            self._post_drain(tid, slot)

    def _stop_drain(self, tid: int) -> None:
        slot = self._draining.pop(tid, None)
        if slot is not None and slot.request is not None:
            self._ucx.retire(slot.request, slot.msg)
            slot.request = None

    def _pre_post(self, rec: _Recv) -> None:
        """From ``expect``: post a direct transfer's receives straight into the destination's
        pools, if it has pools this can land in and their blocks are few runs."""
        transfer = rec.transfer
        pools = transfer.destination
        if not isinstance(pools, PoolDestination) or self.max_segments < 1:
            return
        starts = direct_starts(self.layout, pools.block_ids.tolist(), self.max_segments)
        if starts is None or not DirectReceive.lands(self.layout, pools):
            return
        rec.direct = self._direct_receive(transfer, starts, pools)
        rec.direct.post_all()

    def _direct_receive(
        self, transfer: RecvTransfer, starts: list[int], pools: PoolDestination | None
    ) -> DirectReceive:
        return DirectReceive(
            self._ucx,
            transfer,
            starts,
            pools,
            self._messages,
            self._pool_bytes,
            lambda exc, layer: self._recv_error(exc, transfer, layer),
        )

    def _plan_done(self, rec: _Recv, exc: BaseException | None) -> None:
        """The sender sends this transfer direct."""
        if rec.plan is None or rec.transfer.over:  # over (and forgotten) in this same reap
            rec.plan = None
            return
        transfer, (_, buf) = rec.transfer, rec.plan
        rec.plan = None
        if exc is not None:
            transfer.fail(self._recv_error(exc, transfer, 0))
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
        rec.sender = read_sender(memoryview(buf.numpy()))
        self._drop_framed(rec)
        if rec.direct is None:  # staged in message buffers, then landed like framed messages
            rec.direct = self._direct_receive(transfer, starts, None)
            rec.direct.post_all()
