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
  * direct (plan.py; senders given the receiver's block ids, ids in few runs): a plan, then each
    layer's K and V per run of blocks, from the sender's pools into the receiver's, then a
    trailer with the first token. No gather, no scatter. ``UCXTransport.direct`` sends them
    (ucx_direct_send.py); the receiver lands them in a ``PoolDestination``'s pools itself
    (ucx_direct_recv.py).
  * framed, otherwise: one message per layer (or per layer and prefill chunk), ``[256-byte
    header | K | V]`` (header.py), sub = layer, gathered by the sender (``gather_into``) and
    written into the destination by the receiver (pool_copy.py). The receiver posts receives for
    a window of ``recv_window`` layers per transfer, each into its own buffer; messages beyond
    the window, or for transfers not expected yet, wait in UCX's unexpected queue.
The receiver expects both kinds until the first message of one arrives (ucx_recv.py).

Pieces: ``UCXTransport`` (here) puts together the worker thread (ucx_runtime.py), the message
buffers (ucx_buffers.py), the sending half (ucx_send.py: endpoints, sends, deadlines), the
receiving half (ucx_recv.py) and the direct path.

Threading (ucx_runtime.py): one thread per transport owns the UCX worker and runs all transfer
state: it posts requests, progresses UCX, runs completion callbacks (landing messages too) and
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
  * a receiver drains (takes, drops and counts as stale) late messages of a failed transfer until
    ``drain_seconds`` after its deadline (a sender posts nothing after its own), so a live but late
    sender completes instead of timing out and aborting its endpoint;
  * a sender stopped (SIGSTOP) in the middle of a message writes the rest of it after SIGCONT,
    even though the receiver cancelled the receive (UCX cannot cancel a matched one): the
    transfer settles only when that receive completes, and only then are its blocks freed
    (fence.py, ucx_direct_recv.py);
  * a sender killed in the middle of a message never completes it: the receiver learns that it
    is gone when the kernel closes the sender's liveness connection (liveness.py) and settles
    the transfer a grace second later, instead of holding its blocks until ``fence_timeout_s``.

Throughput and where the time goes: docs/benchmarks.md ("KV transfer", and "GPU" for the first
run on an H100). CUDA buffers go to UCX through ``__cuda_array_interface__`` (cuda_copy/cuda_ipc),
the current stream is synchronised before a send and after a landing (pool_copy.py: UCX writes
the next message into the buffer on a stream of its own), and the worker thread makes a CUDA
context current first, as ucxx's progress thread does. Direct transfers are CPU only.
"""

from __future__ import annotations

import concurrent.futures

import torch

from pdserve.transfer.base import KVTransport, PeerHandle
from pdserve.transfer.fence import BlockFence
from pdserve.transfer.header import KVLayout, LayerHeader, pack_address
from pdserve.transfer.liveness import LivenessListener, pack_endpoint
from pdserve.transfer.pool_copy import KVDestination
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.ucx_buffers import MessagePool, PoolBytes
from pdserve.transfer.ucx_direct_send import UCXDirectPath
from pdserve.transfer.ucx_recv import UCXReceiver
from pdserve.transfer.ucx_runtime import UCXWorkerThread
from pdserve.transfer.ucx_send import UCXPeer, UCXSender

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
# How long a failed transfer's blocks stay held for a message that was half-way in when it failed
# (fence.py), when its sender's liveness connection cannot say whether it is dead or stopped
# (liveness.py). None: for ever. Past it the blocks are freed and a write that still lands is
# counted (late_writes).
DEFAULT_FENCE_TIMEOUT_S = 120.0


class UCXTransport(KVTransport):
    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device = "cpu",
        ucx_options: dict[str, str] | None = None,
        recv_window: int = 8,
        drain_seconds: float = 30.0,
        max_segments: int = DEFAULT_MAX_SEGMENTS,
        fence_timeout_s: float | None = DEFAULT_FENCE_TIMEOUT_S,
        liveness_host: str | None = "127.0.0.1",
        liveness_advertise: str | None = None,
    ) -> None:
        if recv_window < 1:
            raise ValueError(f"recv_window must be >= 1, got {recv_window}")
        self.layout = layout
        self.device = torch.device(device)
        self.max_segments = max_segments  # sent (and landed) direct up to this many segments
        self._closed = False
        self._messages = MessagePool(layout)
        pool_bytes = PoolBytes()
        cpu = CPU_UCX_OPTIONS if self.device.type == "cpu" else {}
        self._ucx = UCXWorkerThread(
            {**DEFAULT_UCX_OPTIONS, **cpu, **(ucx_options or {})}, self.device
        )
        self._sender = UCXSender(self._ucx, layout, self._messages)
        self.fence = BlockFence()
        self._receiver = UCXReceiver(
            self._ucx,
            layout,
            self._messages,
            pool_bytes,
            device=self.device,
            recv_window=recv_window,
            drain_seconds=drain_seconds,
            max_segments=max_segments,
            fence=self.fence,
            fence_timeout_s=fence_timeout_s,
        )
        if max_segments >= 1:
            self.direct = UCXDirectPath(self._sender, layout, pool_bytes, max_segments)
        # senders connect here so that their death is seen (liveness.py); None: no listener
        self._liveness = None
        endpoint = pack_endpoint("", 0)
        if liveness_host is not None:
            self._liveness = LivenessListener(liveness_host, self._receiver.sender_gone)
            self._receiver.liveness = self._liveness
            advertised = liveness_advertise or liveness_host
            endpoint = pack_endpoint(advertised, self._liveness.port)
        self._address = pack_address(layout, endpoint + bytes(self._ucx.worker.address))

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._ucx.running:
                self._ucx.call(self._shutdown, timeout=10.0)
        finally:
            self._closed = self._receiver.closed = self._sender.closed = True
            self._ucx.stop()
            self._sender.links.close()  # after the endpoints: nothing of ours is under way now
            if self._liveness is not None:
                self._liveness.close()

    def _shutdown(self) -> None:
        self._closed = True
        self._receiver.shutdown()
        self._sender.shutdown()

    # -- receiver -----------------------------------------------------------------------------

    def address(self) -> bytes:
        return self._address

    def live_senders(self) -> int:
        """Senders whose liveness connection to this receiver is open (liveness.py)."""
        return self._liveness.senders if self._liveness is not None else 0

    def expect(self, transfer_id: int, destination: KVDestination, timeout: float) -> RecvTransfer:
        return self._receiver.expect(transfer_id, destination, timeout)

    # -- sender -------------------------------------------------------------------------------

    def connect(self, peer_address: bytes) -> UCXPeer:
        return self._sender.connect(peer_address)

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
        return self._sender.send_layer(peer, header, k, v, timeout)

    def disconnect(self, peer: PeerHandle) -> None:
        self._sender.disconnect(peer)
