"""KV transport over UCX (ucxx): worker address + tagged messages; shared memory on one host.

Why this path. The receiver publishes its UCX worker address; the sender creates an endpoint from
it with peer error handling off and sends tagged messages. On one host UCX moves a large message
by rendezvous; for CPU memory its data goes by active messages (``RNDV_SCHEME=am``: the sender
copies it into shared memory, the receiver out of it into the posted buffer, both at once), which
was faster here than the sender's CMA write (``put_zcopy``, kept for GPU memory). The listener and
``create_endpoint(host, port)`` path needs peer error handling, which forces TCP (~1 GiB/s,
MACHINE-NOTES). With error handling off UCX never reports a dead peer, so every receive and
every send here has a deadline instead.

Messages, all under tags ``(transfer_id << 16) | sub``, so concurrent transfers never mix:
  * direct (plan.py, ucx_direct.py; senders given the receiver's block ids, ids in few runs): a
    plan, then each layer's K and V per run of blocks, from the sender's pools into the
    receiver's, then a trailer with the first token. No gather, no scatter.
  * framed, otherwise: one message per layer (or per layer and prefill chunk), ``[256-byte
    header | K | V]`` (header.py), sub = layer, gathered by the sender (``gather_into``) and
    handed to ``on_layer`` (``scatter_into``). The receiver posts receives for a window of
    ``recv_window`` layers per transfer, each into its own buffer; messages beyond the window,
    or for transfers not expected yet, wait in UCX's unexpected queue.
The receiver expects both kinds until the first message of one arrives.

Threading (ucx_runtime.py): one thread per transport owns the UCX worker and runs all transfer
state: it posts requests, progresses UCX, runs completion callbacks (``on_layer`` too) and
deadlines, and sleeps on UCX's epoll fd when idle. The public methods are thread-safe and never
wait on the network, so the engine thread and a grpc.aio loop can both call them: they return
``concurrent.futures.Future`` / ``RecvTransfer`` (``f.result()`` in a thread, ``await`` in asyncio).

Failures, each tried here with processes on loopback and SIGKILL:
  * sender killed between layers, or with messages in flight: the receiver's transfer fails with
    TransferTimeoutError at its deadline, and the receiver lives on. (With ``get_zcopy`` the
    receiver reads the sender's memory: reading a dead sender failed cleanly once, then a receive
    matching another of its messages segfaulted, and so did destroying the worker. Not used.)
  * receiver gone: the first send to it fails at once ("Shared memory error"); if the sender had
    already talked to it, sends never complete: the first to pass its timeout aborts the endpoint
    (UCX cannot cancel a rendezvous send), failing every pending send to that peer;
  * a receiver drains (takes and drops) late messages of a failed transfer for ``drain_seconds``,
    so a live but late sender completes instead of timing out and aborting its endpoint.

Throughput and where the time goes: docs/benchmarks.md ("KV transfer"). Not run here (no GPU): CUDA tensors. CUDA buffers go to UCX through ``__cuda_array_interface__``
(cuda_copy/cuda_ipc), the current stream is synchronised before a send, and the worker thread
makes a CUDA context current first, as ucxx's progress thread does. Direct transfers are CPU only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.transfer.base import (
    KVTransport,
    LayerCallback,
    PeerHandle,
    PeerUnreachableError,
    RecvTransfer,
    TransferError,
    TransferTimeoutError,
    check_layer,
)
from pdserve.transfer.errors import HeaderMismatchError
from pdserve.transfer.header import (
    KVLayout,
    LayerHeader,
    check_transfer_id,
    message_buffer_of,
    pack_address,
    unpack_address,
    write_message,
)
from pdserve.transfer.plan import PLAN_NBYTES, PLAN_SUB, SUB_BITS, message_tag
from pdserve.transfer.ucx_buffers import Message, MessagePool, RawBuffer
from pdserve.transfer.ucx_direct import SETTLE_S, DirectMixin, DirectReceive, PoolBytes
from pdserve.transfer.ucx_runtime import Timer, UCXWorkerThread

# Rendezvous by the sender writing into the receiver (process_vm_writev), not by the receiver
# reading the sender: with get_zcopy, posting a receive that matched messages of a sender that had
# died crashed the receiver (segfault in tag_recv, UCX 1.21, peer error handling off).
DEFAULT_UCX_OPTIONS = {"RNDV_SCHEME": "put_zcopy"}
# CPU memory: rendezvous by active messages (the sender copies the data into shared memory, the
# receiver copies it out into the posted buffer, both at once) rather than by the sender's CMA
# write (process_vm_writev), which moved ~3.5 GB/s here even alone (docs/benchmarks.md). Still a
# rendezvous: a send completes only once the receiver has matched it.
CPU_UCX_OPTIONS = {"RNDV_SCHEME": "am"}
DEFAULT_MAX_SEGMENTS = 2  # direct up to this many segments, else gathered (docs/benchmarks.md)
ANY_LAYER_MASK = ((1 << 64) - 1) ^ ((1 << SUB_BITS) - 1)
CLOSE_PERIOD_NS = 100_000_000


@dataclass(eq=False)
class _Send:
    msg: Message
    result: concurrent.futures.Future[None]
    deadline: float
    where: str
    request: Any = None


@dataclass(eq=False)
class UCXPeer(PeerHandle):
    endpoint: Any = None
    pending: list[_Send] = field(default_factory=list)
    timer: Timer | None = None


@dataclass(eq=False)
class _Recv:
    """A transfer being received: framed slots until a plan says it comes direct."""

    transfer: RecvTransfer
    slots: list[_Slot]
    plan: tuple[Any, torch.Tensor] | None = None  # the plan's receive and buffer, while posted
    direct: DirectReceive | None = None
    framed_seen: bool = False


@dataclass(eq=False)
class _Slot:
    """One receive buffer of a transfer, for layers slot, slot + window, ..."""

    layer: int
    msg: Message
    request: Any = None


class UCXTransport(DirectMixin, KVTransport):
    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device = "cpu",
        ucx_options: dict[str, str] | None = None,
        recv_window: int = 8,
        drain_seconds: float = 30.0,
        max_segments: int = DEFAULT_MAX_SEGMENTS,
    ) -> None:
        if recv_window < 1:
            raise ValueError(f"recv_window must be >= 1, got {recv_window}")
        self.layout = layout
        self.device = torch.device(device)
        self.recv_window = recv_window
        self.drain_seconds = drain_seconds
        self.max_segments = max_segments  # sent direct up to this many segments (0: never)
        self._pool_bytes = PoolBytes()
        self._closed = False
        self._recvs: dict[int, _Recv] = {}
        self._draining: dict[int, _Slot] = {}
        self._peers: set[UCXPeer] = set()
        # sends queued while the worker thread is busy are posted together, after one wake-up
        self._queue: collections.deque[tuple[UCXPeer, int, _Send]] = collections.deque()
        self._queue_lock = threading.Lock()
        self._wake_pending = False
        self._messages = MessagePool(layout)
        cpu = CPU_UCX_OPTIONS if self.device.type == "cpu" else {}
        self._ucx = UCXWorkerThread(
            {**DEFAULT_UCX_OPTIONS, **cpu, **(ucx_options or {})}, self.device
        )
        self._address = pack_address(layout, bytes(self._ucx.worker.address))

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._ucx.running:
                self._ucx.call(self._shutdown, timeout=10.0)
        finally:
            self._closed = True
            self._ucx.stop()

    def _shutdown(self) -> None:
        self._closed = True
        for rec in list(self._recvs.values()):
            tid = rec.transfer.transfer_id
            rec.transfer.fail(TransferError(f"transfer {tid}: transport closed"))
        for tid in list(self._draining):
            self._stop_drain(tid)
        for peer in list(self._peers):
            self._abort(peer, PeerUnreachableError("transport closed"))

    # -- receiver -----------------------------------------------------------------------------

    def address(self) -> bytes:
        return self._address

    def expect(
        self, transfer_id: int, num_blocks: int, on_layer: LayerCallback, timeout: float
    ) -> RecvTransfer:
        transfer = RecvTransfer(self.layout, transfer_id, num_blocks, on_layer, timeout, self._ucx)
        self._call(self._start_recv, transfer)
        return transfer

    def _start_recv(self, transfer: RecvTransfer) -> None:
        tid = transfer.transfer_id
        if self._closed:
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
                self._ucx.forget(slot.request)
                slot.request = None
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
            self._ucx.forget(*rec.plan)
            rec.plan = None
        if rec.direct is not None and rec.direct.cancel_all() and transfer.error is not None:
            transfer.hold_failure(SETTLE_S)  # a write into the pools may be under way
        for slot in rec.slots:
            if slot.request is not None:  # still posted: cancel it
                self._ucx.forget(slot.request, slot.msg)
                slot.request = None
            elif slot.layer < transfer.num_layers:
                self._messages.give(slot.msg)
        exc = transfer.error
        if exc is not None and not isinstance(exc, PeerUnreachableError):  # not from a dead one
            if not self._closed and self.drain_seconds > 0:
                self._start_drain(transfer)

    def _start_drain(self, transfer: RecvTransfer) -> None:
        """Take and drop late messages of a failed transfer, so that their senders complete."""
        tid = transfer.transfer_id
        slot = _Slot(0, self._messages.take(transfer.num_blocks, self.device))
        self._draining[tid] = slot
        self._ucx.call_at(time.monotonic() + self.drain_seconds, self._stop_drain, tid)
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
        if self._draining.get(tid) is slot:
            self._post_drain(tid, slot)

    def _stop_drain(self, tid: int) -> None:
        slot = self._draining.pop(tid, None)
        if slot is not None and slot.request is not None:
            self._ucx.forget(slot.request, slot.msg)
            slot.request = None

    # -- sender -------------------------------------------------------------------------------

    def connect(self, peer_address: bytes) -> UCXPeer:
        raw = unpack_address(peer_address, self.layout)
        return self._call(self._connect, peer_address, raw)

    def _connect(self, blob: bytes, raw: bytes) -> UCXPeer:
        if self._closed:
            raise TransferError("transport closed")
        ucx = self._ucx.ucx
        try:
            address = ucx.UCXAddress.create_from_buffer(raw)
            endpoint = ucx.UCXEndpoint.create_from_worker_address(self._ucx.worker, address, False)
        except ucx.UCXError as exc:
            raise PeerUnreachableError(f"cannot connect to the KV receiver: {exc}") from exc
        peer = UCXPeer(address=blob, endpoint=endpoint)
        self._peers.add(peer)
        return peer

    def layer_buffers(
        self, num_blocks: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        msg = self._messages.take(num_blocks, torch.device(device))
        return msg.k, msg.v

    def send_layer(
        self,
        peer: PeerHandle,
        header: LayerHeader,
        k: torch.Tensor,
        v: torch.Tensor,
        timeout: float,
    ) -> concurrent.futures.Future[None]:
        peer = self._as_peer(peer)
        msg = getattr(k, "_pdserve_message", None)  # gathered in place, into layer_buffers()?
        if msg is not None and msg.v is v and msg.num_blocks == header.num_blocks >= 1:
            header.check(self.layout)  # k and v are this layout's, made by layer_buffers
            check_transfer_id(header.transfer_id)
        else:
            check_layer(self.layout, header, k, v)
            msg = None
            buf = message_buffer_of(k, v)  # into views of a message buffer made elsewhere?
            if buf is not None:
                msg = Message(buf, header.num_blocks, None, None, pooled=False)
        if msg is not None:
            msg.write_header(header)
        else:
            msg = self._messages.take(header.num_blocks, k.device)
            write_message(msg.buf, header, k, v)
        if msg.buf.is_cuda:
            torch.cuda.current_stream(msg.buf.device).synchronize()  # UCX knows no streams
        where = f"transfer {header.transfer_id} layer {header.layer}"
        tag = message_tag(header.transfer_id, header.layer)
        return self._enqueue(peer, tag, msg, time.monotonic() + timeout, where)

    def _enqueue(
        self, peer: UCXPeer, tag: int, msg: Message | RawBuffer, deadline: float, where: str
    ) -> concurrent.futures.Future[None]:
        result: concurrent.futures.Future[None] = concurrent.futures.Future()
        send = _Send(msg, result, deadline, where)  # type: ignore[arg-type]
        with self._queue_lock:
            self._queue.append((peer, tag, send))
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            self._call_soon(self._post_queued)
        return result

    def _as_peer(self, peer: PeerHandle) -> UCXPeer:
        if not isinstance(peer, UCXPeer):
            raise TypeError(f"peer handle {peer!r} was not made by UCXTransport.connect")
        if self._closed:
            raise TransferError("transport closed")
        if not peer.alive:
            raise PeerUnreachableError("peer was disconnected; connect again")
        return peer

    def _post_queued(self) -> None:
        with self._queue_lock:
            queued, self._queue = self._queue, collections.deque()
            self._wake_pending = False
        for peer, tag, send in queued:
            self._post_send(peer, tag, send)

    def _post_send(self, peer: UCXPeer, tag: int, send: _Send) -> None:
        if not send.result.set_running_or_notify_cancel():
            return
        if not peer.alive or peer.endpoint is None:
            send.result.set_exception(PeerUnreachableError(f"{send.where}: peer was disconnected"))
            return
        ucx = self._ucx
        msg = send.msg
        if msg.array is None:
            msg.array = ucx.array(msg.buf)
        send.request = peer.endpoint.tag_send(msg.array, ucx.tag(tag))
        peer.pending.append(send)
        ucx.watch(send.request, lambda exc: self._send_done(peer, send, exc))
        if peer.timer is None or send.deadline < peer.timer.when:
            self._arm(peer, send.deadline)

    def _send_done(self, peer: UCXPeer, send: _Send, exc: BaseException | None) -> None:
        send.request = None
        if send not in peer.pending:
            return  # failed already, by a timeout or disconnect
        peer.pending.remove(send)
        if exc is None:
            self._messages.give(send.msg)
            send.result.set_result(None)
            return
        err = PeerUnreachableError(f"{send.where}: send failed ({exc}); the receiver may be gone")
        send.result.set_exception(err)
        self._abort(peer, PeerUnreachableError(f"a send to this peer failed ({exc})"))

    def _arm(self, peer: UCXPeer, when: float) -> None:
        if peer.timer is not None:
            peer.timer.cancel()
        peer.timer = self._ucx.call_at(when, self._check_deadlines, peer)

    def _check_deadlines(self, peer: UCXPeer) -> None:
        peer.timer = None
        now = time.monotonic()
        late = [send for send in peer.pending if send.deadline <= now]
        if late:  # a rendezvous send cannot be cancelled: the peer is dead or stuck, drop it
            for send in late:
                send.result.set_exception(
                    TransferTimeoutError(
                        f"{send.where}: not taken by the receiver by its deadline; it may be gone"
                    )
                )
            self._abort(peer, PeerUnreachableError("another send to this peer timed out"))
        elif peer.pending:
            self._arm(peer, min(send.deadline for send in peer.pending))

    def disconnect(self, peer: PeerHandle) -> None:
        if isinstance(peer, UCXPeer) and self._ucx.running:
            self._call(self._abort, peer, PeerUnreachableError("peer was disconnected"))

    def _abort(self, peer: UCXPeer, err: TransferError) -> None:
        """Fail every pending send to ``peer`` with ``err`` and close its endpoint."""
        peer.alive = False
        if peer.timer is not None:
            peer.timer.cancel()
            peer.timer = None
        pending, peer.pending = peer.pending, []
        for send in pending:
            if not send.result.done():
                send.result.set_exception(err)
        if peer.endpoint is not None:
            peer.endpoint.close_blocking(period=CLOSE_PERIOD_NS, max_attempts=1)
            peer.endpoint.remove_close_callback()
            peer.endpoint = None
        for send in pending:  # closing the endpoint cancelled them; UCX may still hold buffers
            if send.request is not None:
                self._ucx.forget(send.request, send.msg)
                send.request = None
        self._peers.discard(peer)

    # -- helpers ------------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return self._ucx.call(fn, *args)
        except RuntimeError as exc:
            if not self._ucx.running:
                raise TransferError("transport closed") from exc
            raise

    def _call_soon(self, fn: Any, *args: Any) -> None:
        try:
            self._ucx.call_soon_threadsafe(fn, *args)
        except RuntimeError as exc:
            raise TransferError("transport closed") from exc
