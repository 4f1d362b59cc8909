"""Triton prefill attention over the paged cache (chunked prefill and reused prefixes included).

One program per (sequence, query head, tile of BLOCK_M new tokens) loops over the sequence's
blocks up to the last position its tile can see, with an online softmax in fp32::

    positions   0 ........ prefix-1 | prefix ............ context_len-1
                cached              | new tokens (the sequence's rows of q)
    query row i (position prefix + i) sees keys j <= prefix + i

Every row sees position 0, in the first block, so the running max is finite from then on.
GQA is simple here: each query head reads its kv head's blocks itself (L2 absorbs the repeats).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    q_token_stride,
    q_head_stride,
    bt_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (the interpreter's bf16 arithmetic is wrong)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    t = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    qo_mask = (i < q_len)[:, None] & d_mask[None, :]
    tokens = (q_start + i).to(tl.int64)
    q_offs = tokens[:, None] * q_token_stride + head * q_head_stride + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=qo_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + i

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    last = tl.minimum(context_len, prefix + (tile + 1) * BLOCK_M)  # keys past this: all masked
    for b in range(0, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride + b).to(tl.int64)
        k_pos = b * BLOCK_SIZE + t
        t_mask = (t < BLOCK_SIZE) & (k_pos < context_len)
        rows = (block * BLOCK_SIZE + t) * NUM_KV_HEADS + kv_head
        kv_offs = rows[:, None] * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = t_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = (tokens[:, None] * NUM_HEADS + head) * HEAD_DIM + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """See ``reference.prefill_attention``."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Reading the bound back from query_start_loc waits for the device (the third GPU run: at
    # every layer of a prefill, so the host could not queue the next one): the caller's, else
    # every token (a tile past its own sequence's tokens returns at once).
    max_q_len = num_tokens if max_query_len is None else max_query_len
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, BLOCK_M))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, triton.next_power_of_2(block_size)),
        UPCAST=q.device.type == "cpu",  # CPU tensors only run under TRITON_INTERPRET=1
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
