"""CPU kernels, the attention half: paged decode attention and prefill attention, and the block
copies; and what every CPU kernel module shares (loading a C library, the dtype codes).

The model's projections are in ``gemm.py``, the small per-token ops in ``fused.py``; the package
(``kernels/cpu/__init__.py``) exports all of them with the signatures of ``kernels/reference.py``.
The C libraries are compiled on first use; without a compiler, or for inputs they do not cover
(fp16, non-contiguous tensors), the reference runs instead.

With AVX512-BF16, bf16 attention runs on its own paths of ``paged_attention.c`` (decode: a
sequence's context in parts, bf16 dot products; prefill: 4 queries at a time over 512-key
chunks). fp32 queries (an fp32 model, over fp32 or bf16 pools) take its fp32 paths in every build
(decode by parts on AVX2 or AVX-512, prefill in ``prefill_f32.h``); bf16 elsewhere widens decode
rows to fp32 and prefills through torch's SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from pdserve.kernels import reference
from pdserve.kernels.cpu import block_copy
from pdserve.kernels.cpu.build import BuildError, load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype codes the C kernels take
KV_BF16 = 2  # their code for fp32 activations over bf16 KV pools (an fp32 model's bf16 KV cache)


def kv_code(x_dtype: torch.dtype, pool_dtype: torch.dtype) -> int | None:
    """The dtype code of activations ``x_dtype`` over KV pools of ``pool_dtype`` (attention,
    RoPE's KV write), or None where the C kernels do not take the pair."""
    if x_dtype == pool_dtype:
        return NATIVE_DTYPES.get(x_dtype)
    return KV_BF16 if (x_dtype, pool_dtype) == (torch.float32, torch.bfloat16) else None


def load_or_warn(source: Path, what: str) -> ctypes.CDLL | None:
    """``source`` built and loaded, or None after one warning that names the fallback."""
    try:
        return load_library(source)
    except BuildError as exc:
        logger.warning("CPU %s kernel unavailable (%s); using the reference", what, exc)
        return None


def int32_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (block tables) as int32 with contiguous rows, as the C kernels read it."""
    t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def declare_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a library built from paged_attention.c."""
    fn = lib.pdserve_paged_decode_attention
    fn.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_float] + [ctypes.c_int32] * 2
    )
    fn.restype = ctypes.c_int
    fn = lib.pdserve_prefill_attention_f32
    fn.argtypes = (
        [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_float] + [ctypes.c_int32] * 2
    )
    fn.restype = ctypes.c_int
    if lib.pdserve_paged_attention_native():
        fn = lib.pdserve_prefill_attention_bf16
        fn.argtypes = (
            [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int32]
        )
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_or_warn(_SOURCE, "paged attention")
    return None if lib is None else declare_attention(lib)


def attention_bf16_native() -> bool:
    """Whether bf16 decode attention (head_dim 64 or 128) runs on AVX512-BF16 instructions."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_paged_attention_native())


def attention_f32_512() -> bool:
    """Whether fp32 decode attention (head_dim 64 or 128) runs on the AVX-512 path
    (decode_512.h: a context in parts, every kv head at once); else the portable one."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_paged_attention_f32_512())


def attention_f32_parts() -> bool:
    """Whether fp32 decode attention (head_dim 64 or 128) goes by parts (decode_parts.h, on
    AVX-512 or AVX2 tiles); else the portable path."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_paged_attention_f32_parts())


def native_available() -> bool:
    """Whether the C decode kernel is compiled and loaded (building it if needed)."""
    return _library() is not None


def _native_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and kv_code(q.dtype, k_cache.dtype) is not None
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape
        and q.shape[1] % k_cache.shape[2] == 0
        and q.shape[2] == k_cache.shape[3]
    )


# Plain torch ops are as fast as it gets for these copies (bench/kernels.py): index_copy_ and
# view[slots] = k measured alike; index_select gathers blocks 3-7x faster than cache[ids].
write_kv = reference.write_kv
# Whole blocks move in C, a memcpy per run of consecutive ids (block_copy.c); index_copy_ moved
# bf16 blocks at ~3.5 GB/s, which capped the KV transfer's scatter.
gather_blocks = block_copy.gather_blocks
scatter_blocks = block_copy.scatter_blocks


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``; in C, the blocks read where they are."""
    lib = _library() if _native_ok(q, k_cache, v_cache) else None
    if lib is None:
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = int32_rows(block_tables)
    context_lens = context_lens.to(torch.int32).contiguous()
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    num_bad = lib.pdserve_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_tables.shape[1],
        block_tables.stride(0),
        q.stride(0),
        q.stride(1),
        scale,
        kv_code(q.dtype, k_cache.dtype),
        torch.get_num_threads(),
    )
    if num_bad:
        raise decode_attention_error(num_bad, num_blocks)
    return out


def decode_attention_error(num_bad: int, num_blocks: int) -> Exception:
    """What pdserve_paged_decode_attention's count of refused tasks (or -1) means."""
    if num_bad < 0:
        return MemoryError("paged_decode_attention: the C kernel could not allocate its scratch")
    return ValueError(
        f"paged_decode_attention: {num_bad} (sequence, kv head) tasks have a context_len "
        f"beyond their block table row or block ids outside [0, {num_blocks}); "
        "check block_tables and context_lens"
    )


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
    """See ``reference.prefill_attention``. In C: bf16 with head_dim 64 or 128 on AVX512-BF16
    and fp32 queries with head_dim a multiple of 16 up to 256 in every build (``_prefill_kernel``;
    the fp32 one ~2.1x faster than SDPA at 512 tokens, AVX2 or AVX-512). Otherwise per sequence,
    its context gathered once into SDPA.

    Inputs go in as 4-D ``[1, heads, len, head_dim]``: torch routes 3-D inputs to its math path,
    which materialises the scores and ran 3.5x slower for 512 tokens here.

    With a cached prefix the causal mask is offset by it (torch's ``is_causal`` aligns the
    diagonal top-left, which is right only when the query covers the whole context)::

        key  j:   0 .......... prefix-1   prefix ... context_len-1
        query i:  all visible             visible while j <= prefix + i
    """
    lib = _library() if _native_ok(q, k_cache, v_cache) else None
    kernel = None if lib is None or q.stride(2) != 1 else _prefill_kernel(lib, q, k_cache)
    if kernel is not None:
        fn, extra = kernel
        return _prefill_c(
            fn, extra, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
        )
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        prefix = context_len - (end - start)
        # [1, num_kv_heads, context_len, head_dim], in q's dtype (bf16 pools of an fp32 model)
        k = reference.context_kv(k_cache, block_tables[s], context_len).to(q.dtype)
        v = reference.context_kv(v_cache, block_tables[s], context_len).to(q.dtype)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = None
        if prefix > 0:
            positions = torch.arange(context_len)
            mask = positions[None, :] <= positions[prefix:, None]  # [q_len, context_len]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],  # [1, num_heads, q_len, head_dim]
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _prefill_kernel(lib, q: torch.Tensor, k_cache: torch.Tensor):
    """(the C prefill kernel, its arguments between ``scale`` and the thread count) for these
    inputs, or None (SDPA): the AVX512-BF16 one (``prefill_bf16.h``: bf16, head_dim 64 or 128),
    or the fp32 one in every build (``prefill_f32.h``: fp32 queries over fp32 or bf16 pools,
    head_dim a multiple of 16 up to 256)."""
    head_dim = q.shape[2]
    if q.dtype == k_cache.dtype == torch.bfloat16:
        if head_dim in (64, 128) and lib.pdserve_paged_attention_native():
            return lib.pdserve_prefill_attention_bf16, ()
        return None
    if q.dtype == torch.float32 and head_dim % 16 == 0 and head_dim <= 256:
        return lib.pdserve_prefill_attention_f32, (int(k_cache.dtype == torch.bfloat16),)
    return None


def _prefill_c(fn, extra, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
    """Call a C prefill attention kernel of paged_attention.c's signature (``extra``: its
    arguments between ``scale`` and the thread count)."""
    block_tables = int32_rows(block_tables)
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    num_bad = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        starts.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_tables.shape[1],
        block_tables.stride(0),
        q.stride(0),
        q.stride(1),
        scale,
        *extra,
        torch.get_num_threads(),
    )
    if num_bad:
        raise prefill_attention_error(num_bad, num_blocks)
    return out


def prefill_attention_error(num_bad: int, num_blocks: int) -> Exception:
    """What a C prefill attention kernel's nonzero return means (-2, a head_dim it does not
    take, is checked before calling)."""
    if num_bad < 0:
        return MemoryError("prefill_attention: the C kernel could not allocate its scratch memory")
    return ValueError(
        f"prefill_attention: {num_bad} sequences have a context_len below their new tokens or "
        f"beyond their block table row, or block ids outside [0, {num_blocks}); check "
        "block_tables, query_start_loc and context_lens"
    )
