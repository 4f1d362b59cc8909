"""Tensor kernels over the paged KV cache.

Every backend module exposes the same pure functions (see ``kernels/reference.py``, the spec):

- ``write_kv(k_cache, v_cache, k, v, slot_mapping)``
- ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out``
- ``prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
  max_query_len=None) -> out``
- ``gather_blocks(cache, block_ids) -> buf`` / ``scatter_blocks(cache, block_ids, buf)``
- ``linear(x, weight, bias=None) -> y`` (``x @ weight.T + bias``, the model's projections)
- ``rms_norm(x, weight, eps, residual=None) -> (out, residual)``,
  ``rope_write_kv(qkv, positions, cos, sin, num_heads, k_cache, v_cache, slot_mapping) -> q``,
  ``silu_mul(gate_up) -> out`` (a decoder layer's small per-token ops)
- ``argmax(logits) -> token ids`` (greedy sampling)
- ``empty_pool(shape, dtype, device, resident=False) -> pool`` (an uninitialised KV pool; huge
  pages on CPU; ``resident``: its memory mapped at once, not at each page's first write)
- ``gather_kv_blocks(k_pool, v_pool, block_ids, k_out, v_out)`` and
  ``kv_block_writer(k_pools, v_pools, block_ids) -> write(layer, first, k, v)``: the KV
  transfer's copies (a layer's blocks into a message buffer; a message into every layer's pools)

A backend may also have ``prepack_linear(weight, dtype)`` (the model loader calls it for every
projection with the model's dtype, to make the backend's own weight layout before the first
request) and
``compile_layer_loop(model)`` (a callable that runs a step's decoder layers in place of the
module path, bit for bit the same, or None where it does not apply).

``get_backend(device)`` picks the implementation for a device:

========  ==========================================  =====================================
device    backend                                     falls back to reference when
========  ==========================================  =====================================
cuda      ``kernels.triton`` (Triton kernels)         triton is not installed
cpu       ``kernels.cpu`` (C kernels; SDPA for         the C kernel cannot build, or does
          prefill where they have no path)            not cover the inputs (per call)
other     ``kernels.reference``
========  ==========================================  =====================================

Quantized weights (``kernels/quantized.py``: ``QuantizedWeight``, ``quantize``, ``concat``):
every backend's ``linear`` takes one in place of a dense weight, and
``quantized_embedding(ids, weight, dtype)`` looks rows up in one.

``PDSERVE_KERNEL_BACKEND`` (``envs.kernel_backend()``) forces "reference", "cpu" or "triton".
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch
from pdserve.kernels.quantized import (  # noqa: F401 - re-exported for the engine
    GGUF_TYPES,
    QTYPES,
    QuantizedWeight,
    concat,
    quantize,
)

from pdserve import envs

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "cpu", "triton")


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"pdserve.kernels.{name}")


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on ``device`` (see the table above)."""
    forced = envs.kernel_backend()
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(
                f"PDSERVE_KERNEL_BACKEND={forced!r} is not a kernel backend; use one of {BACKENDS}"
            )
        return _load(forced)
    device_type = torch.device(device).type
    if device_type == "cuda":
        try:
            return _load("triton")
        except ImportError as exc:
            logger.warning("Triton unavailable (%s); CUDA kernels use the reference", exc)
            return _load("reference")
    if device_type == "cpu":
        return _load("cpu")
    return _load("reference")


def release_cpu_thread_pool() -> bool:
    """End the calling thread's idle OpenMP threads, so that the thread that steps the engine is
    the process's only OpenMP master (kernels/cpu/openmp.py says why); False where it cannot."""
    from pdserve.kernels.cpu import openmp

    return openmp.release_thread_pool()


def release_freed_heap() -> bool:
    """Give the C heap's free pages back to the system after a model's load (its dense copies
    replaced by quantized blocks and packed layouts): ``kernels/cpu/memory.py``."""
    from pdserve.kernels.cpu import memory

    return memory.release_freed_heap()
