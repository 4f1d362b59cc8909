"""The small per-token ops of a layer as one Triton kernel each: RMSNorm (with the residual add),
RoPE with the KV-cache write, SiLU-and-multiply. In torch these are ~9, ~16 and ~2 kernels (every
elementwise operator its own launch, ~41 a layer with the projections and attention): the first
GPU run found a batch-1 decode step bound by the host launching them (an H100: 35 ms a step for
the 135M model, ~1 ms a layer; docs/benchmarks.md, "GPU"). Each is a launch here, ~9 a layer.

They round where torch's operators round (bf16: each multiply and add in fp32, then to bf16), so
rope_write_kv equals the reference bit for bit where the compiler does not fuse a multiply and an
add (the interpreter; fp32 on a GPU may take an FMA there); rms_norm sums its squares in another
order and silu_mul has Triton's exp, so they may differ from torch in the last place of a few
elements, as the C kernels do (tests/kernels/test_fused_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pdserve.kernels import reference


@triton.jit
def _rounded(x, IS_BF16: tl.constexpr):
    """fp32 ``x`` rounded to the storage dtype's precision (to nearest, ties to even), as fp32.
    bf16 by hand: the Triton interpreter's casts to bf16 truncate (3.9), a GPU's round."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # residual + x, rounded to the dtype as torch's add is, kept in place
        r = tl.load(residual_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        h = _rounded(r + h, IS_BF16)
        tl.store(residual_ptr + row * N + offs, h.to(dt), mask=mask)
    var = tl.sum(h * h, axis=0) / N
    normed = _rounded(h * tl.math.rsqrt(var + eps), IS_BF16)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, _rounded(w * normed, IS_BF16).to(dt), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.rms_norm``; one program per row, ``residual`` updated in place."""
    n = x.shape[-1] if x.dim() else 0
    if (
        n == 0
        or not x.is_contiguous()
        or weight.shape != (n,)
        or weight.dtype != x.dtype
        or x.dtype not in (torch.float32, torch.bfloat16)
        or not weight.is_contiguous()
        or (
            residual is not None
            and (
                residual.shape != x.shape
                or residual.dtype != x.dtype
                or not residual.is_contiguous()
            )
        )
    ):
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            IS_BF16=x.dtype == torch.bfloat16,
            BLOCK=triton.next_power_of_2(n),
        )
    return out, x if residual is None else residual


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    row_stride,
    max_positions,
    num_slots,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of 2 of NUM_HEADS + NUM_KV_HEADS (rotated heads)
    HALF_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    ok = (pos >= 0) & (pos < max_positions) & (slot >= 0) & (slot < num_slots)
    pos = tl.where(ok, pos, 0)  # nothing of such a token is read or written (masks below)
    slot = tl.where(ok, slot, 0)
    dt = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    # ok as tensors: the interpreter mis-types a tensor & a scalar bool (3.9)
    oki = ok.to(tl.int32)
    mask = (heads < NUM_HEADS + NUM_KV_HEADS) & (d < HALF) & (heads * 0 + d * 0 + oki > 0)
    at = qkv_ptr + token * row_stride + heads * HEAD_DIM + d
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    table = pos * HEAD_DIM + d
    dmask = (d < HALF) & (d * 0 + oki > 0)
    # the tables are fp32; torch casts them to qkv's dtype first
    c1 = _rounded(tl.load(cos_ptr + table, mask=dmask, other=0.0), IS_BF16)
    c2 = _rounded(tl.load(cos_ptr + table + HALF, mask=dmask, other=0.0), IS_BF16)
    s1 = _rounded(tl.load(sin_ptr + table, mask=dmask, other=0.0), IS_BF16)
    s2 = _rounded(tl.load(sin_ptr + table + HALF, mask=dmask, other=0.0), IS_BF16)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each operator rounded
    y1 = _rounded(_rounded(x1 * c1, IS_BF16) + _rounded(-x2 * s1, IS_BF16), IS_BF16).to(dt)
    y2 = _rounded(_rounded(x2 * c2, IS_BF16) + _rounded(x1 * s2, IS_BF16), IS_BF16).to(dt)
    tl.store(at, y1, mask=mask)
    tl.store(at + HALF, y2, mask=mask)
    # the rotated k heads (rows NUM_HEADS..) and v into the token's slot
    kv_row = slot * (NUM_KV_HEADS * HEAD_DIM) + (heads - NUM_HEADS) * HEAD_DIM + d
    kmask = mask & (heads >= NUM_HEADS)
    kt = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + kv_row, y1.to(kt), mask=kmask)
    tl.store(k_cache_ptr + kv_row + HALF, y2.to(kt), mask=kmask)
    v = tl.arange(0, KV_PAD)
    vmask = (v < NUM_KV_HEADS * HEAD_DIM) & (v * 0 + oki > 0)
    src = qkv_ptr + token * row_stride + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + v
    vt = v_cache_ptr.dtype.element_ty
    tl.store(
        v_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + v,
        tl.load(src, mask=vmask, other=0.0).to(vt),
        mask=vmask,
    )


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
    """See ``reference.rope_write_kv``; one program per token, rotating q and k in place in
    ``qkv``. A token whose position or slot is out of range is left as it is and writes nothing
    (the reference would fail on the device; the engine never makes one)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if (
        not reference.rope_operands_ok(qkv, cos, sin, num_heads, k_cache, v_cache)
        or qkv.stride(1) != 1
        or qkv.dtype not in (torch.float32, torch.bfloat16)
        or k_cache.dtype != qkv.dtype
        or v_cache.dtype != qkv.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or positions.shape != (qkv.shape[0],)
        or slot_mapping.shape != positions.shape
    ):
        return reference.rope_write_kv(
            qkv, positions, cos, sin, num_heads, k_cache, v_cache, slot_mapping
        )
    tokens = qkv.shape[0]
    if tokens:
        _rope_write_kv_kernel[(tokens,)](
            qkv,
            positions.contiguous(),
            slot_mapping.contiguous(),
            cos,
            sin,
            k_cache,
            v_cache,
            qkv.stride(0),
            cos.shape[0],
            k_cache.shape[0] * k_cache.shape[1],
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
            HALF_PAD=triton.next_power_of_2(head_dim // 2),
            KV_PAD=triton.next_power_of_2(num_kv_heads * head_dim),
            IS_BF16=qkv.dtype == torch.bfloat16,
        )
    return qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, INTER, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(gate_up_ptr + row * 2 * INTER + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * INTER + INTER + offs, mask=mask, other=0.0)
    silu = _rounded(g / (1.0 + tl.exp(-g)), IS_BF16)  # F.silu, rounded to the dtype
    out = _rounded(silu * up.to(tl.float32), IS_BF16)
    tl.store(out_ptr + row * INTER + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``reference.silu_mul``; one launch."""
    if (
        gate_up.dim() == 0
        or gate_up.shape[-1] % 2
        or not gate_up.is_contiguous()
        or gate_up.dtype not in (torch.float32, torch.bfloat16)
    ):
        return reference.silu_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * inter) if inter else 0
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        _silu_mul_kernel[grid](
            gate_up, out, inter, IS_BF16=gate_up.dtype == torch.bfloat16, BLOCK=block
        )
    return out
