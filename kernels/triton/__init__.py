"""CUDA backend: Triton kernels (they also run on CPU tensors under ``TRITON_INTERPRET=1``)."""

from pdserve.kernels import reference
from pdserve.kernels.triton import fused
from pdserve.kernels.triton.decode_attention import paged_decode_attention
from pdserve.kernels.triton.fused import rms_norm, rope_write_kv, silu_mul
from pdserve.kernels.triton.kv_cache import gather_blocks, scatter_blocks, write_kv
from pdserve.kernels.triton.prefill_attention import prefill_attention

# Decode steps may replay CUDA graphs on this backend (pdserve/decode_graphs.py): its rope_write_kv
# leaves a graph's padding rows (slot -1) alone.
DECODE_GRAPHS = True

# No Triton kernel: F.linear (cuBLAS on CUDA tensors), torch for argmax and for the KV transfer's
# block copies.
argmax = reference.argmax
empty_pool = reference.empty_pool
gather_kv_blocks = reference.gather_kv_blocks
kv_block_writer = reference.kv_block_writer
linear = reference.linear

__all__ = [
    "argmax",
    "empty_pool",
    "fused",
    "gather_blocks",
    "gather_kv_blocks",
    "kv_block_writer",
    "linear",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rope_write_kv",
    "scatter_blocks",
    "silu_mul",
    "write_kv",
]
