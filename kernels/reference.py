"""The executable spec of every kernel, in plain PyTorch: clear rather than fast, any device.

KV cache layout (per layer, K and V alike)::

    cache: [num_blocks, block_size, num_kv_heads, head_dim]   contiguous, fp32 or bf16

    position p of a sequence -> block block_table[p // block_size], offset p % block_size
    slot = block_id * block_size + offset         (cache.view(-1, num_kv_heads, head_dim)[slot])

GQA: query head h reads kv head h // (num_heads // num_kv_heads). Softmax runs in fp32 and the
output comes back in q.dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from pdserve.kernels.quantized import QuantizedWeight, embedding_reference


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place.

    ``slot_mapping`` ``[num_tokens]`` int64 holds one valid slot per token.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def context_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` positions, ``[context_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of queries at ``q_positions`` over keys at positions 0..len(k)-1.

    q ``[q_len, num_heads, head_dim]``, k/v ``[context_len, num_kv_heads, head_dim]``;
    returns ``[q_len, num_heads, head_dim]`` in fp32.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [context_len, num_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    k_positions = torch.arange(k.shape[0], device=q.device)
    visible = k_positions[None, :] <= q_positions[:, None]  # [q_len, context_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole paged context (its own K/V already written).

    q ``[num_seqs, num_heads, head_dim]``; block_tables ``[num_seqs, max_blocks_per_seq]`` int32
    (entries past a sequence's blocks are never read); context_lens ``[num_seqs]`` int32.
    Returns ``[num_seqs, num_heads, head_dim]`` in q.dtype.
    """
    out = torch.empty_like(q)
    for s, context_len in enumerate(context_lens.tolist()):
        k = context_kv(k_cache, block_tables[s], context_len)
        v = context_kv(v_cache, block_tables[s], context_len)
        position = torch.tensor([context_len - 1], device=q.device)
        out[s] = _attend(q[s : s + 1], k, v, position, scale)[0].to(q.dtype)
    return out


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
    """Causal attention for several sequences' new tokens, packed, over their paged contexts.

    q ``[num_tokens, num_heads, head_dim]``; query_start_loc ``[num_seqs + 1]`` int32 (cumulative);
    context_lens ``[num_seqs]`` = cached prefix + new tokens (the new tokens' K/V already written).
    New token i of a sequence with q_len new tokens sits at position context_len - q_len + i::

        positions  0 ........ prefix-1 | prefix ........ context_len-1
                   cached (earlier chunk | new tokens = this sequence's rows of q
                   or a reused prefix)   |

    ``max_query_len``: the most new tokens of any one sequence, if the caller knows it (the
    runner does, on the host): a GPU kernel sizes its grid by it without reading
    ``query_start_loc`` back. Backends that need no such bound ignore it.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        k = context_kv(k_cache, block_tables[s], context_len)
        v = context_kv(v_cache, block_tables[s], context_len)
        positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        out[start:end] = _attend(q[start:end], k, v, positions, scale).to(q.dtype)
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks of one pool into one contiguous ``[len(block_ids), *cache.shape[1:]]`` buffer."""
    return cache.index_select(0, block_ids.long())


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``: write ``buf`` into blocks ``block_ids`` of ``cache``, in place."""
    cache.index_copy_(0, block_ids.long(), buf.to(cache.dtype))


def gather_kv_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """One layer's blocks ``block_ids`` of the K and V pools into ``k_out`` and ``v_out``
    ``[len(block_ids), *pool.shape[1:]]`` (e.g. a KV transfer's message buffer), in place."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=k_pool.device)
    torch.index_select(k_pool, 0, ids, out=k_out)
    torch.index_select(v_pool, 0, ids, out=v_out)


KVBlockWriter = Callable[[int, int, torch.Tensor, torch.Tensor], None]


def kv_block_writer(
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    block_ids: torch.Tensor | Sequence[int],
) -> KVBlockWriter:
    """A ``write(layer, first, k, v)`` that puts ``k`` and ``v`` ``[n, *pool.shape[1:]]`` into
    blocks ``block_ids[first : first + n]`` of layer ``layer``'s K and V pool (a KV transfer
    landing one message). What holds for every call is checked here, once."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=k_pools[0].device)

    def write(layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if first + k.shape[0] > ids.numel():
            raise IndexError(
                f"blocks [{first}, {first + k.shape[0]}) beyond the {ids.numel()} block ids given"
            )
        sel = ids[first : first + k.shape[0]]
        k_pool, v_pool = k_pools[layer], v_pools[layer]
        k_pool.index_copy_(0, sel, k.to(k_pool.dtype))
        v_pool.index_copy_(0, sel, v.to(v_pool.dtype))

    return write


def empty_pool(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, resident: bool = False
) -> torch.Tensor:
    """An uninitialised KV pool (``torch.empty``). ``resident``: a CPU pool's memory is mapped
    now (zeroed), not page by page as blocks are first written (device memory always is)."""
    pool = torch.empty(tuple(shape), dtype=dtype, device=device)
    if resident and pool.device.type == "cpu":
        pool.zero_()
    return pool


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``torch.nn.functional.linear``): x ``[..., K]``, weight ``[N, K]``.

    The model's projections go through this, so a backend can stream the weights its own way
    when only a few rows of x (decode tokens) multiply them. ``weight`` may be a
    ``QuantizedWeight`` (``kernels/quantized.py``): dequantized, then the same.
    """
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


def quantized_embedding(
    ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` of a quantized ``weight`` ``[vocab, hidden]``, dequantized, in ``dtype``."""
    return embedding_reference(ids, weight, dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[..., N]``, or first ``residual = residual + x`` and the norm of that.

    Returns ``(weight * norm, residual)``; ``residual`` is ``x`` when none was given, so a layer
    can always pass the second result on. Backends may update ``residual`` in place. As Hugging
    Face's LlamaRMSNorm: the norm in fp32, cast back, then times the weight in x's dtype.
    """
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of q and k, then k and v into their KV-cache slots.

    qkv ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`` (q, k, v side by side, as the
    fused projection makes them); cos/sin ``[max_positions, head_dim]`` fp32 tables (rotate-half
    convention, cast to qkv's dtype before use, as Hugging Face does); positions and slot_mapping
    ``[num_tokens]``. Returns the rotated q ``[num_tokens, num_heads, head_dim]``. Backends may
    rotate in place.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    c = cos[positions].to(qkv.dtype)[:, None, :]
    s = sin[positions].to(qkv.dtype)[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def rope_operands_ok(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether ``rope_write_kv``'s operands have the layout the fused backends take: ``qkv``
    [tokens, (num_heads + 2 kv heads) x head_dim] with an even head_dim, fp32 contiguous tables
    [max_positions, head_dim] of one shape, K and V pools of one shape (else: the reference)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (
        qkv.dim() == 2
        and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        and head_dim % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape
        and cos.shape[-1] == head_dim
        and k_cache.shape == v_cache.shape
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` where gate_up ``[..., 2 * I]`` holds gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: the index of each row's largest logit (the first if it repeats; the first
    NaN if a row has one). ``logits`` [rows, vocab] -> [rows] int64."""
    return logits.argmax(dim=-1)
