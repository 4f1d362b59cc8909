"""CPU backend: C kernels for paged attention (``ops.py``), the model's projections (``gemm.py``)
and its small fused per-token ops (``fused.py``), all with the reference's signatures."""

from pdserve.kernels.cpu.fused import argmax, rms_norm, rope_write_kv, silu_mul
from pdserve.kernels.cpu.gemm import linear, linear_available, prepack_linear
from pdserve.kernels.cpu.layer_loop import compile_layer_loop
from pdserve.kernels.cpu.ops import (
    attention_bf16_native,
    gather_blocks,
    native_available,
    paged_decode_attention,
    prefill_attention,
    scatter_blocks,
    write_kv,
)

__all__ = [
    "argmax",
    "attention_bf16_native",
    "compile_layer_loop",
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
