"""The KV transport interface: a prefill worker pushes each layer's blocks to a decode worker.

    decode (receiver)                                   prefill (sender)
    addr = t.address()          --- gRPC: addr --->     peer = t.connect(addr)
    rt = t.expect(tid, PoolDestination(k_pools, v_pools, block_ids), timeout)
                                --- gRPC: tid, ids ->   tx = t.start_send(peer, tid, n, timeout,
                                                                          dst_block_ids=ids)
                                                        for layer: compute;
                                                            tx.send_pool_layer(layer, k, v, ids)
    each layer lands in the pools     <--- UCX ---      (returns at once; the send runs behind)
                                                        tx.finish(first token)
    stats = rt.wait()  (or await rt)                    stats = tx.wait()

Modules: ``pool_copy`` (destinations, the copies between messages and pools), ``recv_transfer``
and ``send_transfer`` (one transfer as each side sees it), ``direct`` (sending straight from the
pools, for transports that can: ``KVTransport.direct``), ``header``/``plan`` (the wire format).

Ownership: ``send_layer`` copies K and V into a message buffer before it returns, so the caller may
reuse or free its gathered tensors at once. A ``CallbackDestination``'s ``on_layer`` gets views
into a transport-owned buffer that are valid only during the call. The receiver's blocks stay
reserved until the transfer has *settled* (``rt.settled`` is done: nothing can land in them any
more); a transfer that has not completed by its deadline fails with ``TransferTimeoutError``, and
the caller frees its blocks once it has settled (at once, unless a message was half-way in when
it failed: fence.py, ucx_direct_recv.py).
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.transfer.direct import DirectPath
from pdserve.transfer.fence import BlockFence
from pdserve.transfer.header import KVLayout, LayerHeader, check_transfer_id
from pdserve.transfer.pool_copy import KVDestination
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.send_transfer import SendTransfer
from pdserve.transfer.stats import TransportCounters


@dataclass(eq=False)
class PeerHandle:
    """A sender's connection to one receiver, from ``connect``; implementations subclass it."""

    address: bytes
    alive: bool = True


def check_layer(layout: KVLayout, header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> None:
    """Sender-side check that ``header``, ``k`` and ``v`` describe one layer of ``layout``."""
    header.check(layout)
    check_transfer_id(header.transfer_id)
    shape = (header.num_blocks, *layout.block_shape)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or t.dtype != layout.dtype:
            raise ValueError(
                f"{name} is {t.dtype} {tuple(t.shape)}; header and layout say {layout.dtype} {shape}"
            )
    if header.num_blocks < 1:
        raise ValueError("a message carries at least one block")


class KVTransport(ABC):
    """Moves KV blocks of one layout between workers. One instance per worker process serves both
    roles; every method is safe to call from any thread (not from the transport's own callbacks)."""

    layout: KVLayout
    direct: DirectPath | None = None
    """Sends transfers straight from the sender's pools (direct.py), where this transport can;
    None: every transfer goes framed. ``SendTransfer.send_pool_layer`` uses it."""
    fence: BlockFence | None = None
    """The receiver's block owners and stale-message count (fence.py), where it keeps them."""
    device: torch.device = torch.device("cpu")
    """Where this transport's message buffers live: the worker's device, so that KV in CUDA
    pools is gathered, sent and landed as CUDA memory (UCX: cuda_copy / cuda_ipc)."""

    def counters(self) -> TransportCounters:
        """Stale messages dropped, transfers and blocks not settled yet (fence.py)."""
        return self.fence.counters() if self.fence is not None else TransportCounters()

    # -- receiver (decode worker) -------------------------------------------------------------

    @abstractmethod
    def address(self) -> bytes:
        """The blob senders pass to ``connect``; published once at start-up (e.g. at registration).
        It carries the protocol version and layout hash, so mismatched peers fail at ``connect``."""

    @abstractmethod
    def expect(self, transfer_id: int, destination: KVDestination, timeout: float) -> RecvTransfer:
        """Called by the decode worker at admission, right after reserving the blocks of
        ``destination`` (pool_copy.py). Starts receiving every layer of ``transfer_id`` (messages
        that arrived earlier are kept for it) and lands each in ``destination`` on the transport
        thread. ``transfer_id`` is chosen by the receiver, < 2**48, and never reused: it is the
        generation of the reservation (fence.py). ValueError if a block of ``destination`` still
        belongs to a transfer that has not settled. The returned transfer fails with
        TransferTimeoutError if incomplete after ``timeout`` s."""

    # -- sender (prefill worker) --------------------------------------------------------------

    @abstractmethod
    def connect(self, peer_address: bytes) -> PeerHandle:
        """Called by the prefill worker once per decode worker (the handle is reused for all its
        transfers). Raises HeaderMismatchError if the peer serves another KV layout."""

    @abstractmethod
    def send_layer(
        self,
        peer: PeerHandle,
        header: LayerHeader,
        k: torch.Tensor,
        v: torch.Tensor,
        timeout: float,
    ) -> concurrent.futures.Future[None]:
        """Called by the engine thread after computing a layer, with its gathered blocks
        ``[num_blocks, block_size, num_kv_heads, head_dim]``. Frames them into one message (a
        copy, unless they come from ``layer_buffers``) and returns at once, before delivery; the
        caller may reuse its tensors then. The future completes when the receiver has taken the
        message, or fails with TransferTimeoutError after ``timeout`` s or PeerUnreachableError."""

    @abstractmethod
    def disconnect(self, peer: PeerHandle) -> None:
        """Drop the connection (P stops sending to a D that is gone); pending sends fail."""

    @abstractmethod
    def close(self) -> None:
        """Fail every pending transfer and send, release the transport's threads. Idempotent."""

    def layer_buffers(
        self, num_blocks: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K and V tensors ``[num_blocks, *block_shape]`` to gather one layer into (e.g.
        ``pool_copy.gather_into``). Passed to ``send_layer``, they are sent without the copy;
        they then belong to the transport. Transports with message buffers of their own
        override this to hand those out."""
        shape = (num_blocks, *self.layout.block_shape)
        k = torch.empty(shape, dtype=self.layout.dtype, device=device)
        return k, torch.empty_like(k)

    def start_send(
        self,
        peer: PeerHandle,
        transfer_id: int,
        num_blocks: int,
        timeout: float,
        traceparent: str = "",
        device: str | torch.device | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> SendTransfer:
        """A sender's handle on one transfer: headers, deadline and stats for all its layers.
        ``device``: where its layers are gathered (default: the transport's ``device``);
        ``dst_block_ids``, the receiver's blocks for it, let ``send_pool_layer`` send direct."""
        device = self.device if device is None else device
        return SendTransfer(
            self, peer, transfer_id, num_blocks, timeout, traceparent, device, dst_block_ids
        )

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
