"""CPU kernels, the projections: ``linear(x, weight, bias)`` in C (``linear.c``).

- bf16 where the CPU has AVX512-BF16: any number of rows, on a packed copy of the weight (pairs
  of k interleaved per 64 outputs, made once per weight: ``_packed_weight``).
- A Q4_1 or Q8_0 ``QuantizedWeight`` with bf16 x, there too: from its blocks for up to
  ``HYBRID_MAX_ROWS`` rows, from a packed bf16 copy for more, the same bits either way
  (``hybrid_weight``, ``packed_q4.h``); with ``PDSERVE_BF16_EXACT_Q4_1`` Q4_1 on its exact
  values (``exact_q4.h``: blocks up to ``EXACT_Q4_1_MAX_ROWS``, the same bits either way too);
  other quantized weights go to ``quant.linear``.
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

from pdserve import envs

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
        self.q4x_many_bytes = lib.pdserve_q4x_many_bytes
        self.q4x_many_bytes.argtypes = [ctypes.c_int64] * 2
        self.q4x_many_bytes.restype = ctypes.c_int64
        self.pack_q4x_many = lib.pdserve_pack_q4x_many
        self.pack_q4x_many.argtypes = self.pack.argtypes
        self.pack_q4x_many.restype = None
        self.block_formats = (quant.Q4_1, quant.Q8_0)
        self.hybrid = lib.pdserve_linear_hybrid
        self.hybrid.argtypes = self.linear.argtypes
        self.hybrid.restype = None


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
    ]


# Most rows of x for which a Q4_1 or Q8_0 weight is multiplied from its blocks; more go to its
# packed bf16 copy (compute bound there: for the default model's projections, 2 threads, 12 rows
# took 0.87x, 16 rows 0.99x, 32 rows 1.32x the packed time).
HYBRID_MAX_ROWS = 8
# The same for a Q4_1 weight on its exact values (PDSERVE_BF16_EXACT_Q4_1): its blocks kernel has
# a third of the instructions and ran quicker than the copy up to 96 rows measured (the default
# model's 120 projections from memory, 2 threads, a 2-core Zen 4: 8 rows 4.7 against 9.5 ms, 32
# rows 18.1 against 22.3, 96 rows 53.4 against 55.5; 256 rows 2 % slower).
EXACT_Q4_1_MAX_ROWS = 128
QP_Q4_1X = 103  # packed_q4.h's code for Q4_1 in exact_q4.h's layout
# id(weight) -> (weakref to it, its HybridWeight, the tensors the HybridWeight points into)
_hybrids: dict[int, tuple[weakref.ref, HybridWeight, tuple[torch.Tensor, ...]]] = {}


def hybrid_available() -> bool:
    """Whether a bf16 model's Q4_1 and Q8_0 weights run as ``hybrid_weight``s (AVX512-BF16)."""
    return _packing() is not None


def _made_hybrid(weight) -> HybridWeight | None:
    entry = _hybrids.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def hybrid_rows(weight) -> int:
    """Most rows of x for which ``weight``'s blocks are read: ``HYBRID_MAX_ROWS`` (or
    ``EXACT_Q4_1_MAX_ROWS``) for a weight made a hybrid (a bf16 model's, at load), else 0 (read
    the same way at every row count)."""
    made = _made_hybrid(weight)
    return made.qp_max_rows if made is not None else 0


def hybrid_copy_bytes(weight) -> int:
    """Bytes of the copy that steps of more than ``hybrid_rows(weight)`` rows read (0 if the
    weight is not a hybrid)."""
    entry = _hybrids.get(id(weight))
    return entry[2][0].nbytes if entry is not None and entry[0]() is weight else 0


def hybrid_weight(weight) -> HybridWeight | None:
    """For a Q4_1 or Q8_0 ``QuantizedWeight`` where the CPU multiplies bf16 natively: a packed
    bf16 copy of its dequantized values and its blocks repacked for few rows of x, made on first
    use, dropped with the weight; else None. The bf16 model then reads 4-bit weights in small
    decode steps and runs prefill at the packed kernel's speed. The blocks' outputs
    (``pdserve_linear_qp``) are bit for bit the packed copy's (packed_q4.h), so no output depends
    on the rows a step batches.

    With ``PDSERVE_BF16_EXACT_Q4_1`` (opt-in) a Q4_1 weight is multiplied on its exact values
    instead (exact_q4.h): its blocks in that kernel's layout for up to ``EXACT_Q4_1_MAX_ROWS``
    rows, a copy of 128 + q as bf16 with d and m beside it for more, the same bits either way."""
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
    qt, rows = weight.qtype, HYBRID_MAX_ROWS
    if qt == quant.Q4_1 and envs.bf16_exact_q4_1():
        qt, rows = QP_Q4_1X, EXACT_Q4_1_MAX_ROWS
        packed = memory.weights_empty(packing.q4x_many_bytes(n, k), torch.uint8)
        packing.pack_q4x_many(weight.data.data_ptr(), n, k, packed.data_ptr(), threads)
    else:
        dense = quant.dequantize_rows(weight, 0, n, torch.empty(n, k)).to(torch.bfloat16)
        packed = memory.weights_empty(packing.words(n, k), torch.int32)
        packing.pack(dense.data_ptr(), n, k, packed.data_ptr(), threads)
        del dense
    qp = memory.weights_empty(packing.qp_bytes(n, k, qt), torch.uint8)
    packing.pack_blocks(weight.data.data_ptr(), n, k, qp.data_ptr(), qt, threads)
    desc = HybridWeight(packed.data_ptr(), qp.data_ptr(), rows, qt)
    key = id(weight)
    ref = weakref.ref(weight, lambda _, key=key: _hybrids.pop(key, None))
    _hybrids[key] = (ref, desc, (packed, qp))
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
        if x.dtype == torch.bfloat16 and _hybrid_ok(x, weight, bias):
            hybrid = hybrid_weight(weight)
            if hybrid is not None:
                return _linear_hybrid(x, hybrid, weight.shape, bias)
        return quant.linear(x, weight, bias)
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


def _linear_hybrid(x: torch.Tensor, hybrid: HybridWeight, shape, bias) -> torch.Tensor:
    n, k = shape
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype)
    _packing().hybrid(
        x.data_ptr(),
        ctypes.addressof(hybrid),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        n,
        k,
        torch.get_num_threads(),
    )
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
