"""Between a transfer's messages and the KV pools: where a receiver lands a transfer (its
*destination*, given to ``KVTransport.expect``) and the sender's gather of one layer's blocks.

    PoolDestination(k_pools, v_pools, block_ids)   the decode worker's case: blocks ``block_ids``
                                                   (the transfer's blocks, in order) of every
                                                   layer's K and V pool. A transport may land a
                                                   direct transfer there itself (ucx_direct_recv.py);
                                                   else each message is written in by the kernels'
                                                   ``kv_block_writer`` (C on CPU, a memcpy per run
                                                   of consecutive ids)
    CallbackDestination(num_blocks, on_layer)      anything else: ``on_layer(header, k, v)`` per
                                                   message, on the transport's thread

The copies are the kernels' (``pdserve.kernels.get_backend(device)``), picked once per transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.transfer.header import LayerHeader

LayerCallback = Callable[[LayerHeader, torch.Tensor, torch.Tensor], None]
"""``on_layer(header, k, v)``: K and V ``[header.num_blocks, *block_shape]`` of one message,
views into a transport-owned buffer that are valid only during the call."""


@dataclass(frozen=True, eq=False, init=False)
class PoolDestination:
    """Land the transfer in blocks ``block_ids`` (in the transfer's block order) of every layer's
    K and V pool ``[pool_blocks, *block_shape]``. The blocks belong to the receiver's reservation
    until the transfer has settled (``RecvTransfer.settled``: after its ``wait`` returned or
    raised, and no receive into them is under way); nothing else may write them meanwhile."""

    k_pools: Sequence[torch.Tensor]
    v_pools: Sequence[torch.Tensor]
    block_ids: torch.Tensor  # int64, CPU, contiguous (ints are converted)

    def __init__(
        self,
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
    ) -> None:
        if len(k_pools) != len(v_pools) or not k_pools:
            raise ValueError(f"{len(k_pools)} K pools and {len(v_pools)} V pools")
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu")
        if ids.dim() != 1:
            raise ValueError(f"block_ids must be one-dimensional, got shape {tuple(ids.shape)}")
        object.__setattr__(self, "k_pools", k_pools)
        object.__setattr__(self, "v_pools", v_pools)
        object.__setattr__(self, "block_ids", ids.contiguous())

    @property
    def num_blocks(self) -> int:
        return self.block_ids.numel()


@dataclass(frozen=True, eq=False)
class CallbackDestination:
    """Hand every message of a transfer of ``num_blocks`` blocks to ``on_layer`` instead."""

    num_blocks: int
    on_layer: LayerCallback


KVDestination = PoolDestination | CallbackDestination


def layer_callback(destination: KVDestination) -> LayerCallback:
    """What the receiver calls for each message of a transfer into ``destination``."""
    if isinstance(destination, CallbackDestination):
        return destination.on_layer
    device = destination.k_pools[0].device
    backend = kernels.get_backend(device)
    write = backend.kv_block_writer(destination.k_pools, destination.v_pools, destination.block_ids)
    if device.type != "cuda":
        return lambda header, k, v: write(header.layer, header.block_offset, k, v)

    def on_layer(header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> None:
        # A message in host memory (a CPU sender's direct transfer, staged) is copied over first.
        k, v = k.to(device), v.to(device)
        write(header.layer, header.block_offset, k, v)
        # k and v are the transport's buffer, reused once this returns (UCX writes the next
        # message into it on a stream of its own): the copies out of it must be done by then.
        torch.cuda.current_stream(device).synchronize()

    return on_layer


def gather_into(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Copy blocks ``block_ids`` of one layer's K and V pools into ``k`` and ``v`` (e.g. the
    buffers of ``layer_buffers``): the kernels' ``gather_kv_blocks`` (C on CPU). Pass
    ``block_ids`` as an int64 tensor to spare a conversion per call."""
    kernels.get_backend(k_pool.device).gather_kv_blocks(k_pool, v_pool, block_ids, k, v)
