"""Triton paged decode attention, split along the context (flash decoding), online softmax in fp32.

A program owns one (sequence, kv head, split): it loads the kv head's `group` query heads as
rows and walks its share of the sequence's blocks, reading each K/V row once for all of them::

    q     [GROUP_PAD, HEAD_DIM_PAD]            rows kv_head * group .. + group - 1
    k, v  [BLOCK_N, HEAD_DIM_PAD] per block    rows (block * block_size + t) * num_kv_heads + kv_head
    s     [GROUP_PAD, BLOCK_N] = q . k         masked where position >= context_len

One program per (sequence, kv head) walked a 512-token context alone: at batch 1 that is 3
programs on a 132-SM GPU, ~98 us a layer, 80 % of an H200's decode step (the third GPU run).
So a sequence's blocks are shared among ``num_splits`` programs (as many as it takes to give
the device a few programs per SM, fixed for a batch shape so that a CUDA graph holds it; the
share of each is worked out from the context length inside the kernel). Each writes its
unnormalised output with its running max and sum; a second kernel combines the splits. With one
split the first kernel writes the output itself. The count is an argument, not a constant of the
compiled kernel: one compiled kernel serves every batch size (as a constant, each new batch-size
bucket compiled its own while serving, ~0.4 s: the fourth GPU run's batch-32 steps).

Products are broadcast-and-sum rather than ``tl.dot``: any group size works and decode is bound by
memory, not by math. Loaded values are upcast to fp32 (bf16 arithmetic is wrong in the
interpreter, and the softmax runs in fp32 anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve import envs


@triton.jit(do_not_specialize=["num_splits"])
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
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, num_blocks)

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
    for b in range(first, last):
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

    head_rows = seq.to(tl.int64) * GROUP * NUM_KV_HEADS + heads  # rows of [seq * heads]
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offs = head_rows[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:  # out_ptr: fp32 [seq, head, split, HEAD_DIM + 2] = unnormalised output, max, sum
        base = (head_rows * num_splits + split) * (HEAD_DIM + 2)
        tl.store(out_ptr + base[:, None] + d[None, :], acc, mask=qo_mask)
        tl.store(out_ptr + base + HEAD_DIM, m_i, mask=g < GROUP)
        tl.store(out_ptr + base + HEAD_DIM + 1, l_i, mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_combine_kernel(
    part_ptr,
    out_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (sequence, query head): the splits' outputs weighed by their sums."""
    row = tl.program_id(0).to(tl.int64)  # seq * num_heads + head
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = (row * num_splits + sp) * (HEAD_DIM + 2)
    m = tl.load(part_ptr + base + HEAD_DIM, mask=sp < num_splits, other=float("-inf"))
    l_s = tl.load(part_ptr + base + HEAD_DIM + 1, mask=sp < num_splits, other=0.0)
    mask = (sp < num_splits)[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(part_ptr + base[:, None] + d[None, :], mask=mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no context at all (a padding row)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # an empty split weighs nothing
    total = tl.sum(w * l_s, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


MAX_SPLITS = 32
_sm_counts: dict[int, int] = {}


def num_splits_for(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): enough for ~2 programs per SM, at most MAX_SPLITS; one
    off CUDA (the interpreter); ``PDSERVE_DECODE_SPLITS`` fixes the count (to compare). Depends
    only on the batch's shape, never on its lengths."""
    fixed = envs.decode_splits()
    if fixed is not None:
        if not 1 <= fixed <= MAX_SPLITS:
            raise ValueError(f"PDSERVE_DECODE_SPLITS={fixed}: allowed 1 to {MAX_SPLITS}")
        return fixed
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    # By the batch rounded up to a power of two: a step of n sequences splits as the CUDA graph
    # it replays (captured for the next bucket, 1, 2, 4, 8, ...) does, eager or not.
    programs = max(1, triton.next_power_of_2(num_seqs) * num_kv_heads)
    return max(1, min(MAX_SPLITS, -(-2 * _sm_counts[index] // programs)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``. Each sequence's context is shared among
    ``num_splits_for`` its batch programs per kv head."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    splits = num_splits_for(num_seqs, num_kv_heads, q.device)
    group = num_heads // num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    target = out
    if splits > 1:
        target = torch.empty(
            (num_seqs, num_heads, splits, head_dim + 2), dtype=torch.float32, device=q.device
        )
    head_dim_pad = triton.next_power_of_2(head_dim)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        target,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        splits,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=triton.next_power_of_2(block_size),
        SPLIT=splits > 1,
    )
    if splits > 1:
        _paged_decode_combine_kernel[(num_seqs * num_heads,)](
            target,
            out,
            splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=MAX_SPLITS,
        )
    return out
