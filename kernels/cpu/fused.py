"""CPU kernels, the small per-token ops of a decoder layer, each one C pass (``fused.c``):
``rms_norm`` (with the residual add), ``rope_write_kv`` (RoPE of q and k, then k and v into their
KV-cache slots) and ``silu_mul``; and greedy sampling's ``argmax`` over the logits. Inputs the C code does not cover go to the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from pdserve.kernels import reference
from pdserve.kernels.cpu.ops import NATIVE_DTYPES, kv_code, load_or_warn

_SOURCE = Path(__file__).with_name("fused.c")


def declare_fused(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a library built from fused.c."""
    lib.pdserve_rms_norm.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 2
        + [ctypes.c_float, ctypes.c_int32, ctypes.c_int32]
    )
    lib.pdserve_rms_norm.restype = None
    lib.pdserve_rope_write_kv.argtypes = (
        [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
        ]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
    )
    lib.pdserve_rope_write_kv.restype = ctypes.c_int
    lib.pdserve_silu_mul.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int32, ctypes.c_int32]
    )
    lib.pdserve_silu_mul.restype = None
    lib.pdserve_argmax_rows.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int32,
    ]
    lib.pdserve_argmax_rows.restype = None
    return lib


@functools.cache
def _fused_library() -> ctypes.CDLL | None:
    lib = load_or_warn(_SOURCE, "fused elementwise")
    return None if lib is None else declare_fused(lib)


def _fused_ok(*tensors: torch.Tensor) -> bool:
    """The C kernels take CPU tensors of one native dtype, contiguous, outside autograd."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in NATIVE_DTYPES
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
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // n if n else 0,
        n,
        eps,
        NATIVE_DTYPES[x.dtype],
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
    code = kv_code(qkv.dtype, k_cache.dtype) if k_cache.dtype == v_cache.dtype else None
    pools_ok = code is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    lib = _fused_library() if pools_ok and _fused_ok(qkv) else None
    if lib is None or not reference.rope_operands_ok(qkv, cos, sin, num_heads, k_cache, v_cache):
        return reference.rope_write_kv(
            qkv, positions, cos, sin, num_heads, k_cache, v_cache, slot_mapping
        )
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if positions.shape != (qkv.shape[0],) or slots.shape != positions.shape:
        raise ValueError(
            f"rope_write_kv: {qkv.shape[0]} tokens, {positions.numel()} positions and "
            f"{slots.numel()} slots; give one position and one slot per token"
        )
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = lib.pdserve_rope_write_kv(
        qkv.data_ptr(),
        qkv.shape[0],
        width,
        num_heads,
        num_kv_heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_slots,
        code,
        torch.get_num_threads(),
    )
    if bad:
        raise rope_error(bad, cos.shape[0], num_slots)
    return qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)


def rope_error(bad: int, max_positions: int, num_slots: int) -> ValueError:
    """What pdserve_rope_write_kv's count of refused tokens means."""
    return ValueError(
        f"rope_write_kv: {bad} tokens have a position outside [0, {max_positions}) or a slot "
        f"outside [0, {num_slots}); nothing was written for them"
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``reference.silu_mul``; one C pass."""
    lib = _fused_library() if _fused_ok(gate_up) and gate_up.dim() >= 1 else None
    if lib is None or gate_up.shape[-1] % 2:
        return reference.silu_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    lib.pdserve_silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.numel() // (2 * inter) if inter else 0,
        inter,
        NATIVE_DTYPES[gate_up.dtype],
        torch.get_num_threads(),
    )
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """See ``reference.argmax``; in C for fp32 rows on the CPU."""
    lib = _fused_library()
    if (
        lib is None
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.dtype != torch.float32
        or not logits.is_cpu
        or not logits.is_contiguous()
    ):
        return reference.argmax(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pdserve_argmax_rows(
        logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out
