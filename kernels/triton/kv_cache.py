"""Triton kernels that move K/V rows: write new tokens into slots, gather/scatter whole blocks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_token_stride,
    v_token_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + token * k_token_stride + offs, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, num_kv_heads, head_dim]`` with contiguous rows (a qkv split view is fine)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See ``reference.write_kv``; one program per token."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = _rows(k), _rows(v)
    row = k_cache.shape[2] * k_cache.shape[3]
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    BLOCK_ELEMS: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
    GATHER: tl.constexpr,  # True: dst[i] = src[ids[i]]; False: dst[ids[i]] = src[i]
):
    i = tl.program_id(0)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    if GATHER:
        src, dst = block, i.to(tl.int64)
    else:
        src, dst = i.to(tl.int64), block
    x = tl.load(src_ptr + src * BLOCK_ELEMS + offs, mask=mask)
    tl.store(dst_ptr + dst * BLOCK_ELEMS + offs, x, mask=mask)


_CHUNK = 1024


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    block_elems = src[0].numel()
    grid = (ids.shape[0], triton.cdiv(block_elems, _CHUNK))
    _copy_blocks_kernel[grid](src, dst, ids, BLOCK_ELEMS=block_elems, CHUNK=_CHUNK, GATHER=gather)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """See ``reference.gather_blocks``."""
    buf = torch.empty(
        (block_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device
    )
    if block_ids.shape[0]:
        _copy_blocks(cache, buf, block_ids, gather=True)
    return buf


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """See ``reference.scatter_blocks``."""
    if block_ids.shape[0]:
        _copy_blocks(buf.to(cache.dtype).contiguous(), cache, block_ids, gather=False)
