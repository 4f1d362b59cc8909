"""The UCX transport's sending half: endpoints to receivers, and every tagged send with its deadline.

Sends are queued by any thread (the engine's, mostly) and posted by the UCX worker thread, all
those queued while it was busy after one wake-up. A send completes when the receiver has taken the
message (a rendezvous); UCX cannot cancel one under way, so the first send to a peer that passes
its deadline aborts the endpoint, failing every pending send to that peer (it is dead or stuck).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from pdserve.transfer.base import PeerHandle, check_layer
from pdserve.transfer.errors import PeerUnreachableError, TransferError, TransferTimeoutError
from pdserve.transfer.header import (
    KVLayout,
    LayerHeader,
    check_transfer_id,
    message_buffer_of,
    unpack_address,
    write_message,
)
from pdserve.transfer.liveness import LivenessLinks, new_sender_id, unpack_endpoint
from pdserve.transfer.plan import PLAN_SUB, message_tag
from pdserve.transfer.ucx_buffers import Message, MessagePool, RawBuffer, ucx_array
from pdserve.transfer.ucx_runtime import (
    Timer,
    UCXWorkerThread,
    call_or_closed,
    call_soon_or_closed,
)

CLOSE_PERIOD_NS = 100_000_000


@dataclass(eq=False)
class _Send:
    msg: Message | RawBuffer
    result: concurrent.futures.Future[None]
    deadline: float
    where: str
    request: Any = None
    ready: Any = None  # torch.cuda.Event: the message's writes on its device have run


@dataclass(eq=False)
class UCXPeer(PeerHandle):
    endpoint: Any = None
    pending: list[_Send] = field(default_factory=list)
    timer: Timer | None = None


class UCXSender:
    """Connects to receivers and sends to them; public methods are safe from any thread."""

    def __init__(self, ucx: UCXWorkerThread, layout: KVLayout, messages: MessagePool) -> None:
        self.layout = layout
        self.links = LivenessLinks(new_sender_id())  # liveness.py
        self.closed = False
        self._ucx = ucx
        self._messages = messages
        self._peers: set[UCXPeer] = set()
        # sends queued while the worker thread is busy are posted together, after one wake-up
        self._queue: collections.deque[tuple[UCXPeer, int, _Send]] = collections.deque()
        self._queue_lock = threading.Lock()
        self._wake_pending = False

    # -- any thread ---------------------------------------------------------------------------

    def connect(self, peer_address: bytes) -> UCXPeer:
        host, port, raw = unpack_endpoint(unpack_address(peer_address, self.layout))
        self.links.link(host, port)  # once per receiver: how it learns that this sender died
        return call_or_closed(self._ucx, self._connect, peer_address, raw)

    def send_layer(
        self,
        peer: PeerHandle,
        header: LayerHeader,
        k: torch.Tensor,
        v: torch.Tensor,
        timeout: float,
    ) -> concurrent.futures.Future[None]:
        """A framed message ``[header | K | V]``: written into a pooled message buffer, unless
        ``k`` and ``v`` are already views of one (``layer_buffers``, or message buffers made
        elsewhere)."""
        peer = self.as_peer(peer)
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
        ready = None
        if msg.buf.is_cuda:  # UCX knows no streams: posted once the writes queued so far have run
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(msg.buf.device))
        where = f"transfer {header.transfer_id} layer {header.layer}"
        tag = message_tag(header.transfer_id, header.layer)
        return self.enqueue(peer, tag, msg, time.monotonic() + timeout, where, ready)

    def send_small(
        self, peer: UCXPeer, data: bytes, tid: int, sub: int, timeout: float
    ) -> concurrent.futures.Future[None]:
        """A direct transfer's plan or trailer: ``data`` under sub-tag ``sub``."""
        buf = numpy.frombuffer(data, dtype=numpy.uint8)
        where = f"transfer {tid} {'plan' if sub == PLAN_SUB else 'trailer'}"
        msg = RawBuffer(buf, ucx_array(buf))
        return self.enqueue(peer, message_tag(tid, sub), msg, time.monotonic() + timeout, where)

    def enqueue(
        self,
        peer: UCXPeer,
        tag: int,
        msg: Message | RawBuffer,
        deadline: float,
        where: str,
        ready: Any = None,
    ) -> concurrent.futures.Future[None]:
        """Send ``msg`` under ``tag``: posted by the worker thread soon (once ``ready``, a CUDA
        event, has completed: the calling thread does not wait for its device); fails after
        ``deadline``."""
        result: concurrent.futures.Future[None] = concurrent.futures.Future()
        send = _Send(msg, result, deadline, where, ready=ready)
        with self._queue_lock:
            self._queue.append((peer, tag, send))
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            call_soon_or_closed(self._ucx, self._post_queued)
        return result

    def as_peer(self, peer: PeerHandle) -> UCXPeer:
        if not isinstance(peer, UCXPeer):
            raise TypeError(f"peer handle {peer!r} was not made by UCXTransport.connect")
        if self.closed:
            raise TransferError("transport closed")
        if not peer.alive:
            raise PeerUnreachableError("peer was disconnected; connect again")
        return peer

    def disconnect(self, peer: PeerHandle) -> None:
        if isinstance(peer, UCXPeer) and self._ucx.running:
            call_or_closed(
                self._ucx, self._abort, peer, PeerUnreachableError("peer was disconnected")
            )

    # -- worker thread ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail every pending send (the transport closes)."""
        self.closed = True
        for peer in list(self._peers):
            self._abort(peer, PeerUnreachableError("transport closed"))

    def _connect(self, blob: bytes, raw: bytes) -> UCXPeer:
        if self.closed:
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
        if send.deadline <= time.monotonic():  # e.g. this process was stopped: never post late
            send.result.set_exception(
                TransferTimeoutError(f"{send.where}: deadline passed before it was sent")
            )
            return
        if send.ready is not None:  # the gather and the header on the device (one layer's work)
            send.ready.synchronize()
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
