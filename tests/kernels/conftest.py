"""Shared builders for kernel tests: random paged caches and an independent dense attention.

The dense attention never looks at the paged layout: it takes each sequence's K/V as it was
before it went into the pool, maps query head h to kv head h // group explicitly, and computes
in float64, so a kernel and the reference cannot agree on a shared mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

POISON_BLOCK = 2**30  # block table padding: reading it means reading past a sequence's blocks

# (new tokens, cached prefix) of the prefill attention tests' batch: one query, partial quads of 4
# and blocks of 16, tiles across the diagonal, more keys than one 512-key softmax chunk (the rescale
# between chunks), cached prefixes of any length
PREFILL_BATCH = [
    (1, 0),
    (3, 0),
    (17, 0),
    (70, 0),
    (5, 16),
    (33, 67),
    (1, 130),
    (64, 64),
    (530, 0),
    (21, 600),
]

TOLERANCES = {  # (atol, rtol) for outputs of magnitude ~1
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),  # a few bf16 ulps: output rounding, bf16 P@V on GPU
}


@dataclass
class PagedCase:
    """A pool holding several sequences, and the same K/V as dense per-sequence tensors."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with POISON_BLOCK
    context_lens: torch.Tensor  # [num_seqs] int32
    seq_k: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim], float64
    seq_v: list[torch.Tensor]


def build_paged_case(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    shared_prefix_blocks: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Sequences in shuffled, non-contiguous blocks; unused pool rows hold NaN.

    With ``shared_prefix_blocks`` every sequence reuses sequence 0's first blocks (prefix reuse).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(blocks_needed) + 2
    block_tables = torch.full((len(context_lens), width), POISON_BLOCK, dtype=torch.int32)
    seq_k, seq_v = [], []
    for s, n in enumerate(context_lens):
        shared = min(shared_prefix_blocks, blocks_needed[s]) if s > 0 else 0
        shared_len = min(shared * block_size, n)
        blocks = block_tables[0, :shared].tolist() + [
            free.pop() for _ in range(blocks_needed[s] - shared)
        ]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        if shared_len:
            k[:shared_len] = seq_k[0][:shared_len].to(dtype)
            v[:shared_len] = seq_v[0][:shared_len].to(dtype)
        for p in range(n):  # position p lives at block p // block_size, offset p % block_size
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_k.append(k.double())
        seq_v.append(v.double())
    return PagedCase(
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        seq_k,
        seq_v,
    )


def dense_attention(
    q: torch.Tensor,
    seq_k: list[torch.Tensor],
    seq_v: list[torch.Tensor],
    q_lens: list[int],
    scale: float,
    kv_head_of: str = "h // group",
) -> torch.Tensor:
    """Causal attention of each sequence's last ``q_lens[s]`` positions, packed like q, float64.

    ``kv_head_of="h % num_kv_heads"`` computes a deliberately wrong GQA mapping.
    """
    q = q.double().cpu()
    num_heads = q.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for k, v, q_len in zip(seq_k, seq_v, q_lens, strict=True):
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        context_len = k.shape[0]
        positions = torch.arange(context_len - q_len, context_len)
        visible = torch.arange(context_len)[None, :] <= positions[:, None]
        for h in range(num_heads):
            kv = h // group if kv_head_of == "h // group" else h % num_kv_heads
            scores = (q[start : start + q_len, h] @ k[:, kv].T) * scale
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[start : start + q_len, h] = probs @ v[:, kv]
        start += q_len
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True)
def _seed():
    """Same random q in every run, whatever ran before."""
    torch.manual_seed(0)


@pytest.fixture
def paged_case():
    return build_paged_case


@pytest.fixture
def dense():
    return dense_attention


@pytest.fixture
def close():
    return assert_close
