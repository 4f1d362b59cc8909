"""Triton paged decode attention: one program per (sequence, kv head), online softmax in fp32.

The program loads the kv head's `group` query heads as rows, walks the sequence's blocks in
order and reads each K/V row once for all of them::

    q     [GROUP_PAD, HEAD_DIM_PAD]            rows kv_head * group .. + group - 1
    k, v  [BLOCK_N, HEAD_DIM_PAD] per block    rows (block * block_size + t) * num_kv_heads + kv_head
    s     [GROUP_PAD, BLOCK_N] = q . k         masked where position >= context_len

Products are broadcast-and-sum rather than ``tl.dot``: any group size works and decode is bound by
memory, not by math. Loaded values are upcast to fp32 (bf16 arithmetic is wrong in the
interpreter, and the softmax runs in fp32 anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    q_seq_stride,
    q_head_stride,
    bt_stride,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    t = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    qo_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = seq.to(tl.int64) * q_seq_stride + heads[:, None] * q_head_stride + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=qo_mask, other=0.0).to(tl.float32) * scale

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max per query head
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for b in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride + b).to(tl.int64)
        t_mask = (t < BLOCK_SIZE) & (b * BLOCK_SIZE + t < context_len)
        rows = (block * BLOCK_SIZE + t) * NUM_KV_HEADS + kv_head
        kv_offs = rows[:, None] * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block has a position
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = (seq.to(tl.int64) * GROUP * NUM_KV_HEADS + heads[:, None]) * HEAD_DIM + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(block_size),
    )
    return out
