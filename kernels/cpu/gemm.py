"""CPU kernels, the projections: ``linear(x, weight, bias)`` in C (``linear.c``).

- bf16 where the CPU has AVX512-BF16: any number of rows, on a packed copy of the weight (pairs
  of k interleaved per 64 outputs, made once per weight: ``_packed_weight``).
- A Q4_1 or Q8_0 ``QuantizedWeight`` with bf16 x, there too: from its blocks for up to
  ``HYBRID_MAX_ROWS`` rows, from a packed bf16 copy for more, the same bits either way
  (``hybrid_weight``, ``packed_q4.h``); a generated token's rows on Q4_1's exact values
  (``linear_rows``, ``exact_q4.h``: the same bits at any row count too); other quantized weights
  go to ``quant.linear``.
- Otherwise at most ``LINEAR_MAX_ROWS[dtype]`` rows of x: each weight row streamed once for all
  rows of x (AVX2/FMA tiles, bf16 widened to fp32); more rows go to torch's F.linear.

Other dtypes or devices, non-contiguous tensors and autograd go to ``F.linear`` too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from pdserve.kernels.cpu import memory, quant
from pdserve.kernels.cpu.ops import NATIVE_DTYPES, load_or_warn

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("linear.c")

# Most rows of x for which linear uses the C kernel, per dtype: where torch's F.linear caught
# up (`python -m bench.kernels --only linear --linear-rows ...`: the default model's projections,
# 2 threads, Zen 3 AVX2). fp32: C took 0.5x torch's time at 1-16 rows, 0.8x at 96, 0.84x at 128,
# 1.0x at 160. bf16 (no native bf16 here): torch's matmul ran 5x slower than C at every row count
# measured, up to 1024 (max_num_batched_tokens's default), so prefill uses the C kernel too.
LINEAR_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 1024}
# With AVX512-BF16, bf16 projections of any row count run on pre-packed weights instead
# (_packed_weight, linear.c): the default model's projections, 2 threads, 2-core Zen 4, against
# torch's F.linear: 0.41x its time at 1 row (26-29 GB/s of weights), 0.4x at 4, 0.45x at 8,
# 0.55-0.6x at 32, 0.7x at 64, 0.87x at 512 (~400 GFLOP/s). The price: a second copy of every
# projection's weights.


@functools.cache
def _library() -> ctypes.CDLL | None:
    """linear.c, loaded once for both of its kernels."""
    return load_or_warn(_SOURCE, "linear")


def linear_function(lib: ctypes.CDLL) -> Callable[..., int]:
    """``pdserve_linear`` of a library built from linear.c, with its C signature declared."""
    fn = lib.pdserve_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32] * 2
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _linear_kernel() -> Callable[..., int] | None:
    lib = _library()
    if lib is None:
        return None
    if not lib.pdserve_linear_simd():
        logger.info("CPU linear kernel built without AVX2+FMA (slower than torch); using torch")
        return None
    return linear_function(lib)


class _Packing:
    """linear.c's packed-weight functions, where the CPU multiplies bf16 natively."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.words = lib.pdserve_packed_words
        self.words.argtypes = [ctypes.c_int64] * 2
        self.words.restype = ctypes.c_int64
        self.pack = lib.pdserve_pack_bf16
        self.pack.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        self.pack.restype = None
        self.linear = lib.pdserve_linear_packed
        self.linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
        self.linear.restype = None
        self.qp_bytes = lib.pdserve_qp_bytes
        self.qp_bytes.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int32]
        self.qp_bytes.restype = ctypes.c_int64
        self.pack_blocks = lib.pdserve_pack_blocks
        self.pack_blocks.argtypes = self.pack.argtypes[:4] + [ctypes.c_int32] * 2
        self.pack_blocks.restype = None
        self.block_formats = (quant.Q4_1, quant.Q8_0)
        self.hybrid = lib.pdserve_linear_hybrid
        self.hybrid.argtypes = self.linear.argtypes
        self.hybrid.restype = None
        self.hybrid_rows = lib.pdserve_linear_hybrid_rows
        self.hybrid_rows.argtypes = self.linear.argtypes + [ctypes.c_int64]
        self.hybrid_rows.restype = None


@functools.cache
def _packing() -> _Packing | None:
    lib = _library()
    if lib is None or not lib.pdserve_linear_simd() or not lib.pdserve_linear_bf16_native():
        return None
    return _Packing(lib)


# id(weight) -> (weakref to it, its version counter and data pointer when packed, the packing)
_packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _packed_weight(packing: _Packing, weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s packed copy, made on first use and again whenever the weight changes (its
    version counter moves on in-place writes); dropped with the weight."""
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None:
        ref, version, ptr, packed = entry
        if ref() is weight and version == weight._version and ptr == weight.data_ptr():
            return packed
    n, k = weight.shape
    packed = memory.weights_empty(packing.words(n, k), torch.int32)  # huge pages: read every step
    packing.pack(weight.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    ref = weakref.ref(weight, lambda _, key=key: _packed.pop(key, None))
    _packed[key] = (ref, weight._version, weight.data_ptr(), packed)
    return packed


class HybridWeight(ctypes.Structure):
    """packed_q4.h's HybridWeight: a Q4_1 or Q8_0 weight as ``pdserve_linear_hybrid`` takes it."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("qp", ctypes.c_void_p),
        ("qp_max_rows", ctypes.c_int64),
        ("qt", ctypes.c_int64),
        ("qx", ctypes.c_void_p),
    ]


# Most rows of x for which a Q4_1 or Q8_0 weight is multiplied from its blocks; more go to its
# packed bf16 copy (compute bound there: for the default model's projections, 2 threads, 12 rows
# took 0.87x, 16 rows 0.99x, 32 rows 1.32x the packed time).
HYBRID_MAX_ROWS = 8
QP_Q4_1X = 103  # packed_q4.h's code for Q4_1 in exact_q4.h's layout (generated tokens' rows)
# id(weight) -> (weakref to it, its HybridWeight, the tensors the HybridWeight points into)
_hybrids: dict[int, tuple[weakref.ref, HybridWeight, tuple[torch.Tensor, ...]]] = {}


def hybrid_available() -> bool:
    """Whether a bf16 model's Q4_1 and Q8_0 weights run as ``hybrid_weight``s (AVX512-BF16)."""
    return _packing() is not None


def _hybrid_entry(weight) -> tuple[weakref.ref, HybridWeight, tuple[torch.Tensor, ...]] | None:
    entry = _hybrids.get(id(weight))
    return entry if entry is not None and entry[0]() is weight else None


def _made_hybrid(weight) -> HybridWeight | None:
    entry = _hybrid_entry(weight)
    return None if entry is None else entry[1]


def hybrid_tier(weight) -> tuple[int, int, bool] | None:
    """For a weight made a hybrid: (``HYBRID_MAX_ROWS``, the bytes its packed copy reads beyond
    its blocks', whether only a prompt's rows read it: a Q4_1 weight's generated rows read its
    blocks at any count); else None."""
    entry = _hybrid_entry(weight)
    if entry is None:
        return None
    _, desc, kept = entry
    return desc.qp_max_rows, kept[0].nbytes - weight.nbytes, bool(desc.qx)


def hybrid_weight(weight) -> HybridWeight | None:
    """For a Q4_1 or Q8_0 ``QuantizedWeight`` where the CPU multiplies bf16 natively: a packed
    bf16 copy of its dequantized values and its blocks repacked for few rows of x, made on first
    use, dropped with the weight; else None. The bf16 model then reads 4-bit weights in small
    decode steps and runs prefill at the packed kernel's speed. The blocks' outputs
    (``pdserve_linear_qp``) are bit for bit the packed copy's (packed_q4.h), so no output depends
    on the rows a step batches.

    A Q4_1 weight also gets its blocks in exact_q4.h's layout (``qx``), on which ``linear_rows``
    multiplies generated tokens' rows with the exact weights (at any row count, the same bits)."""
    made = _made_hybrid(weight)
    if made is not None:
        return made
    packing = _packing()
    if (
        packing is None
        or not isinstance(weight, quant.QuantizedWeight)
        or weight.qtype not in packing.block_formats
    ):
        return None
    n, k = weight.shape  # K % 32 == 0 and contiguous blocks: QuantizedWeight holds to both
    threads = torch.get_num_threads()
    dense = quant.dequantize_rows(weight, 0, n, torch.empty(n, k)).to(torch.bfloat16)
    packed = memory.weights_empty(packing.words(n, k), torch.int32)
    packing.pack(dense.data_ptr(), n, k, packed.data_ptr(), threads)
    del dense
    kept = [packed]
    for qt in (weight.qtype, QP_Q4_1X) if weight.qtype == quant.Q4_1 else (weight.qtype,):
        blocks = memory.weights_empty(packing.qp_bytes(n, k, qt), torch.uint8)
        packing.pack_blocks(weight.data.data_ptr(), n, k, blocks.data_ptr(), qt, threads)
        kept.append(blocks)
    qx = kept[2].data_ptr() if len(kept) == 3 else None
    desc = HybridWeight(packed.data_ptr(), kept[1].data_ptr(), HYBRID_MAX_ROWS, weight.qtype, qx)
    key = id(weight)
    ref = weakref.ref(weight, lambda _, key=key: _hybrids.pop(key, None))
    _hybrids[key] = (ref, desc, tuple(kept))
    return desc


def prepack_linear(
    weight: torch.Tensor | quant.QuantizedWeight, dtype: torch.dtype | None = None
) -> None:
    """Pack a projection's weight now (the model loader calls this), not at its first use. A
    quantized weight by ``dtype``, the model's (x's): bf16, the hybrid's copy of its Q4_1 or Q8_0
    blocks (``hybrid_weight``); fp32, the integer path's copy (``quant.integer_copy``). Whatever
    the kernels read as it is (a quantized weight's blocks where no hybrid stands in for them, a
    dense weight that is not packed) moves to huge pages (``memory.weights_copy``: 0.91x the
    time of the default model's fp32 projections at one row, 2 threads, on the Xeon of
    memory.py)."""
    if isinstance(weight, quant.QuantizedWeight):
        if dtype == torch.bfloat16 and hybrid_weight(weight) is not None:
            return
        weight.data = memory.weights_copy(weight.data)
        if dtype == torch.float32:
            quant.integer_copy(weight)
        return
    if not (weight.is_cpu and weight.dim() == 2 and weight.is_contiguous()):
        return
    packing = _packing()
    if packing is not None and weight.dtype == torch.bfloat16:
        _packed_weight(packing, weight)
    elif weight.dtype in (torch.float32, torch.bfloat16):
        weight.data = memory.weights_copy(weight.data)


def linear_available() -> bool:
    """Whether the C linear kernel is compiled and loaded (building it if needed)."""
    return _linear_kernel() is not None


def _linear_native_ok(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int
) -> bool:
    """Whether the C kernels cover these inputs (they do not do autograd). Runs on every call of
    every projection, so plain checks, cheapest first."""
    if (
        weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] != weight.shape[1]
        or not 0 < x.numel() <= max_rows * x.shape[-1]
        or weight.dtype != x.dtype
        or not x.is_cpu
        or not weight.is_cpu
        or not x.is_contiguous()
        or not weight.is_contiguous()
    ):
        return False
    if bias is not None and (
        bias.dtype != x.dtype
        or not bias.is_cpu
        or bias.shape != (weight.shape[0],)
        or not bias.is_contiguous()
    ):
        return False
    return not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See ``reference.linear``; which kernel takes which inputs: see the module's docstring.
    A ``QuantizedWeight`` goes to the hybrid (bf16 x, Q4_1/Q8_0, AVX512-BF16) or ``quant.linear``."""
    if isinstance(weight, quant.QuantizedWeight):
        y = _hybrid_linear(x, weight, bias)
        return y if y is not None else quant.linear(x, weight, bias)
    packing = _packing() if x.dtype == torch.bfloat16 else None
    max_rows = 1 << 62 if packing is not None else LINEAR_MAX_ROWS.get(x.dtype, 0)
    if not _linear_native_ok(x, weight, bias, max_rows):
        return F.linear(x, weight, bias)
    kernel = None if packing is not None else _linear_kernel()
    if packing is None and kernel is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if packing is not None:
        packing.linear(
            x.data_ptr(),
            _packed_weight(packing, weight).data_ptr(),
            bias_ptr,
            y.data_ptr(),
            rows,
            n,
            k,
            threads,
        )
    elif kernel(
        x.data_ptr(),
        weight.data_ptr(),
        bias_ptr,
        y.data_ptr(),
        rows,
        n,
        k,
        NATIVE_DTYPES[x.dtype],
        threads,
    ):
        raise MemoryError("linear: the C kernel could not allocate its scratch memory")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def _hybrid_ok(x: torch.Tensor, weight, bias: torch.Tensor | None) -> bool:
    """Whether ``pdserve_linear_hybrid`` covers these inputs (bf16 x and bias, no autograd)."""
    k = weight.shape[1]
    return (
        x.dim() > 0
        and x.shape[-1] == k
        and 0 < x.numel()
        and x.is_cpu
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and (
            bias is None
            or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (weight.shape[0],))
        )
    )


def _hybrid_linear(x: torch.Tensor, weight, bias, prompt_rows: int | None = None):
    """A quantized ``weight``'s product on its hybrid (bf16 x, a weight ``hybrid_weight`` takes),
    else None. ``prompt_rows``: ``pdserve_linear_hybrid_rows`` (the rest generated rows, on the
    exact values where the weight has them); None: every row a prompt's."""
    if x.dtype != torch.bfloat16 or not _hybrid_ok(x, weight, bias):
        return None
    hybrid = hybrid_weight(weight)
    if hybrid is None:
        return None
    return _linear_hybrid(x, hybrid, weight.shape, bias, prompt_rows)


def _linear_hybrid(
    x: torch.Tensor, hybrid: HybridWeight, shape, bias, prompt_rows: int | None = None
) -> torch.Tensor:
    n, k = shape
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype)
    args = [
        x.data_ptr(),
        ctypes.addressof(hybrid),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        n,
        k,
        torch.get_num_threads(),
    ]
    if prompt_rows is None:
        _packing().hybrid(*args)
    else:
        _packing().hybrid_rows(*args, prompt_rows)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prompt_rows: int
) -> torch.Tensor:
    """``linear`` of a step's rows, the first ``prompt_rows`` of them prompt tokens and the rest
    generated ones (decode), which a bf16 model's Q4_1 hybrids multiply on their exact weights
    (exact_q4.h; prompt rows on their bf16 rounding, as ``linear`` does every row): a token's
    outputs are the same bits whatever else the step holds."""
    if isinstance(weight, quant.QuantizedWeight):
        y = _hybrid_linear(x, weight, bias, prompt_rows)
        if y is not None:
            return y
    return linear(x, weight, bias)
