"""CUDA backend: Triton kernels (they also run on CPU tensors under ``TRITON_INTERPRET=1``)."""

from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.kv_cache import gather_blocks, scatter_blocks, write_kv
from kernels.triton.prefill_attention import prefill_attention

__all__ = [
    "gather_blocks",
    "paged_decode_attention",
    "prefill_attention",
    "scatter_blocks",
    "write_kv",
]
