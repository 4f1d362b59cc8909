"""CPU backend: the C paged decode kernel and SDPA-based prefill (see ``ops.py``)."""

from kernels.cpu.ops import (
    gather_blocks,
    native_available,
    paged_decode_attention,
    prefill_attention,
    scatter_blocks,
    write_kv,
)

__all__ = [
    "gather_blocks",
    "native_available",
    "paged_decode_attention",
    "prefill_attention",
    "scatter_blocks",
    "write_kv",
]
