"""CPU kernels: paged decode attention in C (blocks read in place), prefill through torch's SDPA,
and a C linear layer for the few rows of x of a decode step.

Same signatures as ``kernels/reference.py``. The C libraries are compiled on first use; without a
compiler, or for inputs they do not cover (fp16, non-contiguous tensors), the reference runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu import block_copy
from kernels.cpu.build import BuildError, load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_LINEAR_SOURCE = Path(__file__).with_name("linear.c")
_FUSED_SOURCE = Path(__file__).with_name("fused.c")
_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Most rows of x for which ops.linear uses the C kernel, per dtype: where torch's F.linear caught
# up (`python -m bench.kernels --only linear --linear-rows ...`: the default model's projections,
# 2 threads, Zen 3 AVX2). fp32: C took 0.5x torch's time at 1-16 rows, 0.8x at 96, 0.84x at 128,
# 1.0x at 160. bf16 (no native bf16 here): torch's matmul ran 5x slower than C at every row count
# measured, up to 1024 (max_num_batched_tokens's default), so prefill uses the C kernel too.
LINEAR_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 1024}
# With AVX512-BF16, bf16 projections of any row count run on pre-packed weights instead
# (_packed_weight, linear.c): the default model's projections, 2 threads, 2-core Zen 4, against
# torch's F.linear: 0.41x its time at 1 row (26-29 GB/s of weights), 0.4x at 4, 0.45x at 8,
# 0.55-0.6x at 32, 0.7x at 64, 0.87x at 512 (~400 GFLOP/s). The price: a second copy of every
# projection's weights.


def _load(source: Path, what: str) -> ctypes.CDLL | None:
    """``source`` built and loaded, or None after one warning that names the fallback."""
    try:
        return load_library(source)
    except BuildError as exc:
        logger.warning("CPU %s kernel unavailable (%s); using the reference", what, exc)
        return None


def declare_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a library built from paged_attention.c."""
    fn = lib.pdserve_paged_decode_attention
    fn.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_float] + [ctypes.c_int32] * 2
    )
    fn.restype = ctypes.c_int
    if lib.pdserve_paged_attention_native():
        fn = lib.pdserve_prefill_attention_bf16
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int32]
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = _load(_SOURCE, "paged attention")
    return None if lib is None else declare_attention(lib)


def linear_function(lib: ctypes.CDLL) -> Callable[..., int]:
    """``pdserve_linear`` of a library built from linear.c, with its C signature declared."""
    fn = lib.pdserve_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32] * 2
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _linear_kernel() -> Callable[..., int] | None:
    lib = _load(_LINEAR_SOURCE, "linear")
    if lib is None:
        return None
    if not lib.pdserve_linear_simd():
        logger.info("CPU linear kernel built without AVX2+FMA (slower than torch); using torch")
        return None
    return linear_function(lib)


class _Packing:
    """linear.c's packed-weight functions, where the CPU multiplies bf16 natively."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.words = lib.pdserve_packed_words
        self.words.argtypes = [ctypes.c_int64] * 2
        self.words.restype = ctypes.c_int64
        self.pack = lib.pdserve_pack_bf16
        self.pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int32]
        self.pack.restype = None
        self.linear = lib.pdserve_linear_packed
        self.linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
        self.linear.restype = None


@functools.cache
def _packing() -> _Packing | None:
    lib = _load(_LINEAR_SOURCE, "linear")
    if lib is None or not lib.pdserve_linear_simd() or not lib.pdserve_linear_bf16_native():
        return None
    return _Packing(lib)


# id(weight) -> (weakref to it, its version counter and data pointer when packed, the packing)
_packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _packed_weight(packing: _Packing, weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s packed copy, made on first use and again whenever the weight changes (its
    version counter moves on in-place writes); dropped with the weight."""
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None:
        ref, version, ptr, packed = entry
        if ref() is weight and version == weight._version and ptr == weight.data_ptr():
            return packed
    n, k = weight.shape
    packed = torch.empty(packing.words(n, k), dtype=torch.int32)
    packing.pack(weight.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    ref = weakref.ref(weight, lambda _, key=key: _packed.pop(key, None))
    _packed[key] = (ref, weight._version, weight.data_ptr(), packed)
    return packed


def prepack_linear(weight: torch.Tensor) -> None:
    """Pack a projection's weight now (the model loader calls this), not at its first use."""
    packing = _packing()
    if packing is not None and weight.dtype == torch.bfloat16 and weight.dim() == 2 and (
        weight.is_cpu and weight.is_contiguous()
    ):
        _packed_weight(packing, weight)


def attention_bf16_native() -> bool:
    """Whether bf16 decode attention (head_dim 64 or 128) runs on AVX512-BF16 instructions."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_paged_attention_native())


def declare_fused(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a library built from fused.c."""
    lib.pdserve_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [
        ctypes.c_float, ctypes.c_int32, ctypes.c_int32]
    lib.pdserve_rms_norm.restype = None
    lib.pdserve_rope_write_kv.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 3
        + [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])
    lib.pdserve_rope_write_kv.restype = ctypes.c_int
    lib.pdserve_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [
        ctypes.c_int32, ctypes.c_int32]
    lib.pdserve_silu_mul.restype = None
    return lib


@functools.cache
def _fused_library() -> ctypes.CDLL | None:
    lib = _load(_FUSED_SOURCE, "fused elementwise")
    return None if lib is None else declare_fused(lib)


def native_available() -> bool:
    """Whether the C decode kernel is compiled and loaded (building it if needed)."""
    return _library() is not None


def linear_available() -> bool:
    """Whether the C linear kernel is compiled and loaded (building it if needed)."""
    return _linear_kernel() is not None


def _native_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in _NATIVE_DTYPES
        and q.dtype == k_cache.dtype == v_cache.dtype
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
    """See ``reference.paged_decode_attention``; one C task per (sequence, kv head)."""
    lib = _library() if _native_ok(q, k_cache, v_cache) else None
    if lib is None:
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
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
        _NATIVE_DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    if num_bad:
        raise ValueError(
            f"paged_decode_attention: {num_bad} (sequence, kv head) tasks have a context_len "
            f"beyond their block table row or block ids outside [0, {num_blocks}); "
            "check block_tables and context_lens"
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See ``reference.prefill_attention``; per sequence, its context gathered once into SDPA.

    Inputs go in as 4-D ``[1, heads, len, head_dim]``: torch routes 3-D inputs to its math path,
    which materialises the scores and ran 3.5x slower for 512 tokens here.

    With a cached prefix the causal mask is offset by it (torch's ``is_causal`` aligns the
    diagonal top-left, which is right only when the query covers the whole context)::

        key  j:   0 .......... prefix-1   prefix ... context_len-1
        query i:  all visible             visible while j <= prefix + i
    """
    lib = _library() if _native_ok(q, k_cache, v_cache) else None
    if (
        lib is not None
        and q.dtype == torch.bfloat16
        and q.shape[2] in (64, 128)
        and q.stride(2) == 1
        and lib.pdserve_paged_attention_native()
    ):
        return _prefill_native(lib, q, k_cache, v_cache, block_tables, query_start_loc,
                               context_lens, scale)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        prefix = context_len - (end - start)
        # [1, num_kv_heads, context_len, head_dim]
        k = reference.context_kv(k_cache, block_tables[s], context_len).transpose(0, 1)[None]
        v = reference.context_kv(v_cache, block_tables[s], context_len).transpose(0, 1)[None]
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


def _prefill_native(lib, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
    """The AVX512-BF16 prefill kernel (bf16, head_dim 64 or 128): see paged_attention.c."""
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    num_bad = lib.pdserve_prefill_attention_bf16(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), out.data_ptr(), lens.shape[0], num_heads,
        num_kv_heads, head_dim, block_size, num_blocks, block_tables.shape[1],
        block_tables.stride(0), q.stride(0), q.stride(1), scale, torch.get_num_threads(),
    )
    if num_bad < 0:
        raise MemoryError("prefill_attention: the C kernel could not allocate its scratch memory")
    if num_bad:
        raise ValueError(
            f"prefill_attention: {num_bad} sequences have a context_len below their new tokens or "
            f"beyond their block table row, or block ids outside [0, {num_blocks}); check "
            "block_tables, query_start_loc and context_lens"
        )
    return out


def _linear_native_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      max_rows: int) -> bool:
    """Whether the C kernels cover these inputs (they do not do autograd). Runs on every call of
    every projection, so plain checks, cheapest first."""
    if (
        weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] != weight.shape[1]
        or not 0 < x.numel() <= max_rows * x.shape[-1]
        or weight.dtype != x.dtype
        or not x.is_cpu
        or not weight.is_cpu
        or not x.is_contiguous()
        or not weight.is_contiguous()
    ):
        return False
    if bias is not None and (
        bias.dtype != x.dtype
        or not bias.is_cpu
        or bias.shape != (weight.shape[0],)
        or not bias.is_contiguous()
    ):
        return False
    return not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See ``reference.linear``. bf16 where the CPU has AVX512-BF16: any number of rows, in C
    on a packed copy of the weight. Otherwise in C for at most ``LINEAR_MAX_ROWS[dtype]`` rows of
    x: torch's fp32 GEMV reads the weights at about half the memory bandwidth, its emulated bf16
    one slows down with every extra row; the C kernel reads each weight row once for all rows of
    x (``linear.c``). More rows, other dtypes or devices, non-contiguous tensors and autograd go
    to ``F.linear``.
    """
    n, k = weight.shape
    if x.dtype == torch.bfloat16 and _linear_native_ok(x, weight, bias, 1 << 62):
        packing = _packing()
        if packing is not None:
            rows = x.numel() // k
            y = torch.empty(rows, n, dtype=x.dtype)
            packing.linear(x.data_ptr(), _packed_weight(packing, weight).data_ptr(),
                           None if bias is None else bias.data_ptr(), y.data_ptr(), rows, n, k,
                           torch.get_num_threads())
            return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    ok = _linear_native_ok(x, weight, bias, LINEAR_MAX_ROWS.get(x.dtype, 0))
    kernel = _linear_kernel() if ok else None
    if kernel is None:
        return F.linear(x, weight, bias)
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype)
    status = kernel(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        n,
        k,
        _NATIVE_DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    if status:
        raise MemoryError("linear: the C kernel could not allocate its scratch memory")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def _fused_ok(*tensors: torch.Tensor) -> bool:
    """The C kernels take CPU tensors of one native dtype, contiguous, outside autograd."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in _NATIVE_DTYPES
        and all(t.dtype == first.dtype and t.is_contiguous() for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.rms_norm``; one C pass per row, ``residual`` updated in place."""
    operands = (x, weight) if residual is None else (x, weight, residual)
    lib = _fused_library() if _fused_ok(*operands) and x.dim() >= 1 else None
    if (
        lib is None
        or weight.shape != x.shape[-1:]
        or (residual is not None and residual.shape != x.shape)
    ):
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    n = x.shape[-1]
    lib.pdserve_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.numel() // n if n else 0, n, eps, _NATIVE_DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return out, x if residual is None else residual


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
    """See ``reference.rope_write_kv``; in C, rotating q and k in place in ``qkv``."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    lib = _fused_library() if _fused_ok(qkv, k_cache, v_cache) else None
    if (
        lib is None
        or qkv.dim() != 2
        or qkv.shape[1] != width
        or head_dim % 2
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != sin.shape
        or cos.shape[-1] != head_dim
        or k_cache.shape != v_cache.shape
    ):
        return reference.rope_write_kv(qkv, positions, cos, sin, num_heads, k_cache, v_cache,
                                       slot_mapping)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if positions.shape != (qkv.shape[0],) or slots.shape != positions.shape:
        raise ValueError(
            f"rope_write_kv: {qkv.shape[0]} tokens, {positions.numel()} positions and "
            f"{slots.numel()} slots; give one position and one slot per token"
        )
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = lib.pdserve_rope_write_kv(
        qkv.data_ptr(), qkv.shape[0], width, num_heads, num_kv_heads, head_dim,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_slots,
        _NATIVE_DTYPES[qkv.dtype], torch.get_num_threads(),
    )
    if bad:
        raise ValueError(
            f"rope_write_kv: {bad} tokens have a position outside [0, {cos.shape[0]}) or a slot "
            f"outside [0, {num_slots}); nothing was written for them"
        )
    return qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``reference.silu_mul``; one C pass."""
    lib = _fused_library() if _fused_ok(gate_up) and gate_up.dim() >= 1 else None
    if lib is None or gate_up.shape[-1] % 2:
        return reference.silu_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    lib.pdserve_silu_mul(
        gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter) if inter else 0, inter,
        _NATIVE_DTYPES[gate_up.dtype], torch.get_num_threads(),
    )
    return out
