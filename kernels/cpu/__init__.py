"""CPU backend: C kernels for paged decode attention, the model's linears and its small fused
ops (RMSNorm, RoPE + KV write, SiLU-mul), SDPA-based prefill (see ``ops.py``)."""

from kernels.cpu.ops import (
    attention_bf16_native,
    gather_blocks,
    linear,
    linear_available,
    native_available,
    paged_decode_attention,
    prefill_attention,
    prepack_linear,
    rms_norm,
    rope_write_kv,
    scatter_blocks,
    silu_mul,
    write_kv,
)

__all__ = [
    "attention_bf16_native",
    "gather_blocks",
    "linear",
    "linear_available",
    "native_available",
    "paged_decode_attention",
    "prefill_attention",
    "prepack_linear",
    "rms_norm",
    "rope_write_kv",
    "scatter_blocks",
    "silu_mul",
    "write_kv",
]
