"""The KV transport interface: a prefill worker pushes each layer's blocks to a decode worker.

    decode (receiver)                                   prefill (sender)
    addr = t.address()          --- gRPC: addr --->     peer = t.connect(addr)
    rt = t.expect(tid, n, on_layer, timeout)
                                --- gRPC: tid, n -->    tx = t.start_send(peer, tid, n, timeout)
                                                        for layer: compute; tx.send_layer(layer, k, v)
    on_layer(header, k, v) per layer  <--- UCX ---      (returns at once; the send runs behind)
    stats = rt.wait()  (or await rt)                    stats = tx.wait()

Ownership: ``send_layer`` copies K and V into a message buffer before it returns, so the caller may
reuse or free its gathered tensors at once. ``on_layer`` gets views into a transport-owned buffer
that are valid only during the call: scatter them into the reserved blocks before returning.
The receiver's blocks stay reserved until ``rt.wait()`` returns or raises; a transfer that has not
completed by its deadline fails with ``TransferTimeoutError`` and the caller frees its blocks.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.kernels.cpu import block_copy
from pdserve.transfer.errors import (
    HeaderMismatchError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.header import KVLayout, LayerHeader, check_transfer_id
from pdserve.transfer.transfers import (
    DirectPlan,
    LayerCallback,
    PeerHandle,
    RecvTransfer,
    SendTransfer,
    TransferStats,
)

__all__ = [
    "HeaderMismatchError",
    "KVTransport",
    "LayerCallback",
    "PeerHandle",
    "PeerUnreachableError",
    "RecvTransfer",
    "SendTransfer",
    "TransferError",
    "TransferStats",
    "TransferTimeoutError",
    "check_layer",
    "gather_into",
    "scatter_into",
]


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

    # -- receiver (decode worker) -------------------------------------------------------------

    @abstractmethod
    def address(self) -> bytes:
        """The blob senders pass to ``connect``; published once at start-up (e.g. at registration).
        It carries the protocol version and layout hash, so mismatched peers fail at ``connect``."""

    @abstractmethod
    def expect(
        self, transfer_id: int, num_blocks: int, on_layer: LayerCallback, timeout: float
    ) -> RecvTransfer:
        """Called by the decode worker at admission, right after reserving ``num_blocks`` blocks.
        Starts receiving every layer of ``transfer_id`` (messages that arrived earlier are kept
        for it) and calls ``on_layer(header, k, v)`` on the transport thread as each lands.
        ``transfer_id`` is chosen by the receiver, unique among its transfers, < 2**48.
        The returned transfer fails with TransferTimeoutError if incomplete after ``timeout`` s."""

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
        ``torch.index_select(pool, 0, ids, out=k)``). Passed to ``send_layer``, they are sent
        without the copy; they then belong to the transport. Implementations may override."""
        shape = (num_blocks, *self.layout.block_shape)
        k = torch.empty(shape, dtype=self.layout.dtype, device=device)
        return k, torch.empty_like(k)

    # -- conveniences -------------------------------------------------------------------------

    def start_send(
        self,
        peer: PeerHandle,
        transfer_id: int,
        num_blocks: int,
        timeout: float,
        traceparent: str = "",
        device: str | torch.device = "cpu",
        dst_block_ids: Sequence[int] | None = None,
    ) -> SendTransfer:
        """A sender's handle on one transfer: headers, deadline and stats for all its layers.
        ``dst_block_ids``, the receiver's blocks for it, let ``send_pool_layer`` send direct."""
        return SendTransfer(
            self, peer, transfer_id, num_blocks, timeout, traceparent, device, dst_block_ids
        )

    # -- direct transfers (plan.py); transports that cannot send them keep these ----------------

    def plan_direct(
        self,
        tx: SendTransfer,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        src_block_ids: list[int],
        timeout: float,
    ) -> tuple[DirectPlan, concurrent.futures.Future[None]] | None:
        """Start sending ``tx`` straight from pools like ``k_pool``/``v_pool``: make its plan,
        send it, return it with the plan message's future; None: send it framed."""
        return None

    def send_direct(
        self,
        peer: PeerHandle,
        plan: DirectPlan,
        layer: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        timeout: float,
    ) -> list[concurrent.futures.Future[None]]:
        raise NotImplementedError

    def send_trailer(
        self, peer: PeerHandle, header: LayerHeader, timeout: float
    ) -> concurrent.futures.Future[None]:
        raise NotImplementedError

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gather_into(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Copy blocks ``block_ids`` of one layer's K and V pools into ``k`` and ``v`` (e.g. the
    buffers of ``layer_buffers``): in C on CPU, a memcpy per run of consecutive ids
    (kernels/cpu/block_copy.c), else ``index_select``. Pass ``block_ids`` as an int64 tensor to
    spare a conversion per call."""
    lib = block_copy.library()
    if (
        lib is not None
        and isinstance(block_ids, torch.Tensor)
        and block_ids.dtype == torch.int64
        and block_ids.device.type == "cpu"
        and block_ids.is_contiguous()
        and block_copy.native_ok(k_pool, k)
        and block_copy.native_ok(v_pool, v)
        and k_pool.shape == v_pool.shape
        and k.shape[0] == v.shape[0] == block_ids.numel()
    ):  # the engine thread's case, once per layer: both in C, checked once
        n, ids, pool_blocks = block_ids.numel(), block_ids.data_ptr(), k_pool.shape[0]
        block_bytes = block_copy.block_nbytes(k_pool)
        bad = lib.gather(k.data_ptr(), k_pool.data_ptr(), pool_blocks, ids, n, block_bytes)
        bad += lib.gather(v.data_ptr(), v_pool.data_ptr(), pool_blocks, ids, n, block_bytes)
        if bad:
            raise IndexError(f"block ids outside [0, {pool_blocks}) of the sender's pools")
        return
    block_copy.gather_blocks_into(k_pool, block_ids, k)
    block_copy.gather_blocks_into(v_pool, block_ids, v)


class Landing(NamedTuple):
    """Where ``scatter_into``'s callback writes (its ``landing`` attribute): contiguous CPU
    pools of one dtype and shape, and the transfer's block ids in them (int64). A transport may
    land a direct transfer's data there itself instead of calling it (ucx_direct.py)."""

    k_pools: Sequence[torch.Tensor]
    v_pools: Sequence[torch.Tensor]
    block_ids: torch.Tensor


def scatter_into(
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    scatter: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> LayerCallback:
    """An ``on_layer`` that writes each message into the receiver's own ``block_ids`` of the
    per-layer pools. ``scatter(pool, ids, buf)`` defaults to the C block copy for contiguous CPU
    pools (a memcpy per run of consecutive ids: kernels/cpu/block_copy.c), else to
    ``pool.index_copy_(0, ids, buf)``."""
    if scatter is None:
        native = _native_scatter(k_pools, v_pools, block_ids)
        if native is not None:
            return native
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=k_pools[0].device)

    def on_layer(header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> None:
        sel = ids[header.block_offset : header.block_offset + header.num_blocks]
        if scatter is None:
            k_pools[header.layer].index_copy_(0, sel, k)
            v_pools[header.layer].index_copy_(0, sel, v)
        else:
            scatter(k_pools[header.layer], sel, k)
            scatter(v_pools[header.layer], sel, v)

    return on_layer


def _native_scatter(
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
) -> LayerCallback | None:
    """``scatter_into``'s callback as two C calls per message (it runs on the transport's
    thread, once per message: checks that hold for the whole transfer are made here, once)."""
    lib = block_copy.library()
    first = k_pools[0]
    if lib is None or first.device.type != "cpu" or len(k_pools) != len(v_pools):
        return None
    if not all(
        p.device.type == "cpu"
        and p.is_contiguous()
        and p.dtype == first.dtype
        and p.shape == first.shape
        for p in (*k_pools, *v_pools)
    ):
        return None
    ids = block_copy.block_ids_tensor(block_ids)
    ids_ptr, num_ids = ids.data_ptr(), ids.numel()
    pool_blocks, block_bytes = first.shape[0], block_copy.block_nbytes(first)
    dtype, block_shape = first.dtype, first.shape[1:]
    scatter = lib.scatter

    def on_layer(header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> None:
        start, n = header.block_offset, header.num_blocks
        if start + n > num_ids:
            raise IndexError(f"blocks [{start}, {start + n}) beyond the {num_ids} block ids given")
        if not (
            k.dtype == dtype == v.dtype
            and k.shape[1:] == block_shape == v.shape[1:]
            and k.shape[0] == n == v.shape[0]
            and k.is_contiguous()
            and v.is_contiguous()
            and k.device.type == "cpu" == v.device.type
        ):
            sel = ids[start : start + n]
            k_pools[header.layer].index_copy_(0, sel, k.to(dtype))
            v_pools[header.layer].index_copy_(0, sel, v.to(dtype))
            return
        at = ids_ptr + start * 8  # int64 ids
        bad = scatter(
            k_pools[header.layer].data_ptr(), pool_blocks, k.data_ptr(), at, n, block_bytes
        )
        bad += scatter(
            v_pools[header.layer].data_ptr(), pool_blocks, v.data_ptr(), at, n, block_bytes
        )
        if bad:
            raise IndexError(f"block ids outside [0, {pool_blocks}) of the receiver's pools")

    on_layer.landing = Landing(k_pools, v_pools, ids)  # type: ignore[attr-defined]
    return on_layer  # its closure keeps ``ids`` (and so ids_ptr) alive
