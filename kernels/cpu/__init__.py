"""CPU backend: the C paged decode kernel, SDPA-based prefill, the C linear (see ``ops.py``)."""

from kernels.cpu.ops import (
    gather_blocks,
    linear,
    linear_available,
    native_available,
    paged_decode_attention,
    prefill_attention,
    scatter_blocks,
    write_kv,
)

__all__ = [
    "gather_blocks",
    "linear",
    "linear_available",
    "native_available",
    "paged_decode_attention",
    "prefill_attention",
    "scatter_blocks",
    "write_kv",
]
