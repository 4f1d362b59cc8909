"""Block gather/scatter between a paged KV pool and a contiguous buffer, in C (``block_copy.c``):
each run of consecutive block ids is one memcpy.

``gather_blocks``/``scatter_blocks``, ``gather_kv_blocks`` and ``kv_block_writer`` have the
reference's signatures (the package exports them); the last two are the KV transfer's copies: a
layer's blocks into a message buffer (sender), a message's blocks into every layer's pools
(receiver). Inputs the C code does not cover (not CPU, not contiguous, dtypes or block shapes that
differ) and machines without a compiler go to torch's index_select/index_copy_.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from pdserve.kernels import reference
from pdserve.kernels.cpu.build import BuildError, load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("block_copy.c")

BlockIds = torch.Tensor | Sequence[int]


class BlockCopy:
    """The C functions, with their signatures declared (``library()``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.gather = lib.pdserve_gather_blocks  # (out, pool, pool_blocks, ids, n, block_bytes)
        self.gather.argtypes = [ptr, ptr, i64, ptr, i64, i64]
        self.gather.restype = i64
        self.scatter = lib.pdserve_scatter_blocks  # (pool, pool_blocks, buf, ids, n, block_bytes)
        self.scatter.argtypes = [ptr, i64, ptr, ptr, i64, i64]
        self.scatter.restype = i64


@functools.cache
def library() -> BlockCopy | None:
    """The compiled functions, or None (after one warning) if they cannot be built here."""
    try:
        return BlockCopy(load_library(_SOURCE))
    except BuildError as exc:
        logger.warning("C block copy unavailable (%s); using index_select/index_copy_", exc)
        return None


def block_ids_tensor(block_ids: BlockIds) -> torch.Tensor:
    """``block_ids`` as a contiguous int64 CPU tensor (what the C functions read)."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu")
    return ids if ids.is_contiguous() else ids.contiguous()


def native_ok(cache: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether the C copy covers ``cache`` (a pool) and ``buf`` (a contiguous run of blocks)."""
    return (
        cache.device.type == "cpu"
        and buf.device.type == "cpu"
        and cache.dtype == buf.dtype
        and cache.dim() >= 1
        and cache.shape[1:] == buf.shape[1:]
        and cache.is_contiguous()
        and buf.is_contiguous()
    )


def block_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one block of ``cache`` (``cache[i]``)."""
    return math.prod(cache.shape[1:]) * cache.element_size()


def _raise_bad(num_bad: int, cache: torch.Tensor) -> None:
    raise IndexError(
        f"{num_bad} block ids outside [0, {cache.shape[0]}) of a pool of {cache.shape[0]} blocks"
    )


def gather_blocks_into(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = cache[block_ids[i]]`` for every i; returns ``out`` ``[len(ids), *cache.shape[1:]]``."""
    lib = library()
    if lib is None or not native_ok(cache, out):
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        return torch.index_select(cache, 0, ids, out=out)
    ids = block_ids_tensor(block_ids)
    if out.shape[0] != ids.numel():
        raise ValueError(f"out holds {out.shape[0]} blocks, block_ids name {ids.numel()}")
    bad = lib.gather(
        out.data_ptr(),
        cache.data_ptr(),
        cache.shape[0],
        ids.data_ptr(),
        ids.numel(),
        block_nbytes(cache),
    )
    if bad:
        _raise_bad(bad, cache)
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """See ``reference.gather_blocks``."""
    out = torch.empty((len(block_ids), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    return gather_blocks_into(cache, block_ids, out)


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """See ``reference.scatter_blocks``: ``cache[block_ids[i]] = buf[i]``, in place."""
    lib = library()
    if lib is None or not native_ok(cache, buf):
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        cache.index_copy_(0, ids, buf.to(cache.dtype))
        return
    ids = block_ids_tensor(block_ids)
    if buf.shape[0] != ids.numel():
        raise ValueError(f"buf holds {buf.shape[0]} blocks, block_ids name {ids.numel()}")
    bad = lib.scatter(
        cache.data_ptr(),
        cache.shape[0],
        buf.data_ptr(),
        ids.data_ptr(),
        ids.numel(),
        block_nbytes(cache),
    )
    if bad:
        _raise_bad(bad, cache)


def gather_kv_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: BlockIds,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """See ``reference.gather_kv_blocks``: in C, a memcpy per run of consecutive ids. Pass
    ``block_ids`` as a contiguous int64 CPU tensor to spare a conversion per call."""
    lib = library()
    if (
        lib is not None
        and isinstance(block_ids, torch.Tensor)
        and block_ids.dtype == torch.int64
        and block_ids.device.type == "cpu"
        and block_ids.is_contiguous()
        and native_ok(k_pool, k_out)
        and native_ok(v_pool, v_out)
        and k_pool.shape == v_pool.shape
        and k_out.shape[0] == v_out.shape[0] == block_ids.numel()
    ):  # a KV sender's case, once per layer: both in C, checked once
        n, ids, pool_blocks = block_ids.numel(), block_ids.data_ptr(), k_pool.shape[0]
        nbytes = block_nbytes(k_pool)
        bad = lib.gather(k_out.data_ptr(), k_pool.data_ptr(), pool_blocks, ids, n, nbytes)
        bad += lib.gather(v_out.data_ptr(), v_pool.data_ptr(), pool_blocks, ids, n, nbytes)
        if bad:
            raise IndexError(f"block ids outside [0, {pool_blocks}) of the sender's pools")
        return
    gather_blocks_into(k_pool, block_ids, k_out)
    gather_blocks_into(v_pool, block_ids, v_out)


def kv_block_writer(
    k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], block_ids: BlockIds
) -> reference.KVBlockWriter:
    """See ``reference.kv_block_writer``: two C calls per message for contiguous CPU pools of one
    dtype and shape (it runs on a KV transport's thread, once per message: what holds for the
    whole transfer is checked here, once); the reference's for other pools."""
    lib = library()
    first_pool = k_pools[0]
    if (
        lib is None
        or first_pool.device.type != "cpu"
        or len(k_pools) != len(v_pools)
        or not all(
            p.device.type == "cpu"
            and p.is_contiguous()
            and p.dtype == first_pool.dtype
            and p.shape == first_pool.shape
            for p in (*k_pools, *v_pools)
        )
    ):
        return reference.kv_block_writer(k_pools, v_pools, block_ids)
    ids = block_ids_tensor(block_ids)
    ids_ptr, num_ids = ids.data_ptr(), ids.numel()
    pool_blocks, nbytes = first_pool.shape[0], block_nbytes(first_pool)
    dtype, block_shape = first_pool.dtype, first_pool.shape[1:]
    scatter = lib.scatter

    def write(layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        if first + n > num_ids:
            raise IndexError(f"blocks [{first}, {first + n}) beyond the {num_ids} block ids given")
        if not (
            k.dtype == dtype == v.dtype
            and k.shape[1:] == block_shape == v.shape[1:]
            and n == v.shape[0]
            and k.is_contiguous()
            and v.is_contiguous()
            and k.device.type == "cpu" == v.device.type
        ):
            sel = ids[first : first + n]
            k_pools[layer].index_copy_(0, sel, k.to(dtype))
            v_pools[layer].index_copy_(0, sel, v.to(dtype))
            return
        at = ids_ptr + first * 8  # int64 ids
        bad = scatter(k_pools[layer].data_ptr(), pool_blocks, k.data_ptr(), at, n, nbytes)
        bad += scatter(v_pools[layer].data_ptr(), pool_blocks, v.data_ptr(), at, n, nbytes)
        if bad:
            raise IndexError(f"block ids outside [0, {pool_blocks}) of the receiver's pools")

    return write  # its closure keeps ``ids`` (and so ids_ptr) alive
