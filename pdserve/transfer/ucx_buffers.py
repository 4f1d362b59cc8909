"""Buffers of the UCX transport: pooled message buffers (framed messages), raw views and the
pools' bytes (direct).

Fresh memory costs page faults (~0.3 ms per MB here) and the views of a buffer ~10 us of Python
per message to make, so message buffers are reused together with what is made of them once.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pdserve.transfer.header import KVLayout, LayerHeader, header_view, message_views, write_header

MAX_POOLED_PER_SIZE = 64
MAX_CACHED_POOLS = 1024


class Message:
    """A message buffer ``[header | K | V]`` and what is made of it once, not per message: the K
    and V views for ``num_blocks`` blocks (None for a buffer of another size), ucxx's view of it,
    and a writable view of its header (CPU). Pooled by ``MessagePool``."""

    __slots__ = ("buf", "num_blocks", "k", "v", "array", "head", "pooled")

    def __init__(self, buf: torch.Tensor, num_blocks: int, k: Any, v: Any, pooled: bool) -> None:
        self.buf, self.num_blocks, self.k, self.v, self.pooled = buf, num_blocks, k, v, pooled
        self.array: Any = None
        self.head = header_view(buf)

    def write_header(self, header: LayerHeader) -> None:
        if self.head is not None:
            self.head[:] = header.pack()
        else:
            write_header(self.buf, header)


class MessagePool:
    """Message buffers for ``layout``, reused: fresh memory costs page faults (~0.3 ms per MB
    here), and their views cost ~10 us of Python per message to make. Any thread."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._free: dict[tuple[int, torch.device], list[Message]] = {}
        self._lock = threading.Lock()

    def take(self, num_blocks: int, device: torch.device) -> Message:
        if device.type == "cuda" and device.index is None:  # as ``give`` files it: buf.device
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            free = self._free.get((num_blocks, device))
            if free:
                return free.pop()
        nbytes = self.layout.message_nbytes(num_blocks)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        k, v = message_views(buf, LayerHeader.for_layer(self.layout, 0, 0, num_blocks))
        msg = Message(buf, num_blocks, k, v, pooled=True)
        k._pdserve_message = msg  # how send_layer knows its own buffers: no search, no checks
        return msg

    def give(self, msg: Message) -> None:
        if not msg.pooled:
            return
        with self._lock:
            free = self._free.setdefault((msg.num_blocks, msg.buf.device), [])
            if len(free) < MAX_POOLED_PER_SIZE:
                free.append(msg)


class RawBuffer:
    """Memory a direct transfer sends from or lands in (a run of blocks of a pool), for the
    request bookkeeping that ``Message`` gets: never pooled."""

    __slots__ = ("buf", "array", "pooled")

    def __init__(self, buf: Any, array: Any) -> None:
        self.buf, self.array, self.pooled = buf, array, False


def pool_ok(layout: KVLayout, *pools: torch.Tensor) -> bool:
    """Whether ``pools`` are contiguous CPU pools of ``layout``'s blocks, all of one size (what a
    direct transfer sends from or lands in)."""
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


def ucx_array(view: Any) -> Any:
    """ucxx's view of a numpy array or a CUDA tensor (no copy); ucxx is imported on first use."""
    from ucxx._lib.arr import Array

    return Array(view)
