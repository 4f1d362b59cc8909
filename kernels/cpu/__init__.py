"""CPU backend: C kernels for paged attention (``ops.py``), the model's projections (``gemm.py``),
its small fused per-token ops (``fused.py``) and the KV transfer's block copies (``block_copy.py``),
all with the reference's signatures; KV pools on huge pages (``memory.py``)."""

from pdserve.kernels.cpu.block_copy import gather_kv_blocks, kv_block_writer
from pdserve.kernels.cpu.fused import argmax, rms_norm, rope_write_kv, silu_mul
from pdserve.kernels.cpu.gemm import (
    hybrid_available,
    hybrid_tier,
    linear,
    linear_available,
    linear_rows,
    prepack_linear,
)
from pdserve.kernels.cpu.layer_loop import compile_layer_loop
from pdserve.kernels.cpu.memory import empty_pool
from pdserve.kernels.cpu.ops import (
    attention_bf16_native,
    gather_blocks,
    native_available,
    paged_decode_attention,
    prefill_attention,
    scatter_blocks,
    write_kv,
)
from pdserve.kernels.cpu.quant import embedding as quantized_embedding

__all__ = [
    "argmax",
    "attention_bf16_native",
    "compile_layer_loop",
    "empty_pool",
    "gather_blocks",
    "gather_kv_blocks",
    "hybrid_available",
    "hybrid_tier",
    "kv_block_writer",
    "linear",
    "linear_available",
    "linear_rows",
    "native_available",
    "paged_decode_attention",
    "prefill_attention",
    "prepack_linear",
    "quantized_embedding",
    "rms_norm",
    "rope_write_kv",
    "scatter_blocks",
    "silu_mul",
    "write_kv",
]
