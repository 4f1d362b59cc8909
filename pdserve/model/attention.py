"""Attention over the paged KV cache for a mixed batch: prefill chunks first, then decode tokens.

    token index:  0 ........ num_prefill_tokens-1 | num_prefill_tokens ... num_tokens-1
    belongs to:   prefill chunks, packed per seq   | one decode token per sequence

Every token's K/V is written to its slot first (``ops.rope_write_kv``, with the rotary
embedding); then the prefill part attends with ``prefill_attention`` and the decode part with
``paged_decode_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefill_seqs + 1] int32
    prefill_context_lens: torch.Tensor | None  # [num_prefill_seqs] int32, cached + new tokens
    decode_block_tables: torch.Tensor | None  # [num_decode_seqs, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode_seqs] int32, including the new token
    prefill_max_query_len: int | None = None  # most new tokens of a prefill sequence, if known


@dataclass
class OutputRows:
    """The tokens whose final hidden states are wanted (the sampled ones), for the last layer:
    ``indices`` [n] int64 rows of the batch, in order; ``meta`` the attention of those rows alone,
    as a batch of their own: a prefill row is its sequence's one query over its whole context
    (the same arithmetic as within its chunk), decode rows are as in the batch. Its
    ``slot_mapping`` is unused (their K/V is written with the batch's)."""

    indices: torch.Tensor
    meta: AttentionMetadata


def paged_attention(
    ops,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every token of the batch; its own K/V are in the cache already
    (``ops.rope_write_kv``)."""
    k_cache, v_cache = kv_cache
    if q.shape[0] == 0:
        return q
    n = meta.num_prefill_tokens
    parts = []
    if n:
        parts.append(
            ops.prefill_attention(
                q[:n],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_context_lens,
                scale,
                meta.prefill_max_query_len,
            )
        )
    if n < q.shape[0]:
        parts.append(
            ops.paged_decode_attention(
                q[n:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
