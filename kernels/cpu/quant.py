"""CPU kernels for quantized weights (``quant.c``): ``linear`` and the embedding lookup on a
``QuantizedWeight`` (``kernels/quantized.py``), the GGUF blocks read as they are.

- fp32 x on Q4_1 (and Q8_0 with AVX-512 VNNI), up to ``integer_rows`` rows (AVX2 8; VNNI any,
  a prompt's too): in integer arithmetic on a repacked copy of the blocks (``quant_int.h``).
- Otherwise up to ``QLINEAR_MAX_ROWS`` rows of x (decode): in C, the weights streamed once per
  pass and dequantized in registers (few rows) or a few rows at a time into an L1 scratch (more
  rows).
- More rows (prefill): the weight dequantized into one fp32 buffer (whole, or ``TILE_BYTES`` of
  rows at a time when larger than ``WHOLE_BYTES``) and multiplied by torch's GEMM into a
  row-major output.

Three builds of ``quant.c``, one per instruction set: "native" (AVX-512 where the CPU has it,
else AVX2), "avx2" (``-mno-avx512f``) and "portable" (``-mno-avx``); ``PDSERVE_QUANT_ISA``
picks the one the backend uses (tests build each), none wider than ``PDSERVE_CPU_ISA`` allows.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import torch
from pdserve.kernels.cpu import build, memory
from pdserve.kernels.cpu.build import BuildError, load_library
from pdserve.kernels.quantized import QTYPES, QuantizedWeight

from pdserve import envs

_SOURCE = Path(__file__).with_name("quant.c")
ISA_FLAGS = {isa: ("-ffp-contract=off", *flags) for isa, flags in build.ISA_FLAGS.items()}
ISA_CODES = {0: "portable", 256: "avx2", 512: "avx512"}
# Most rows of x for the C float kernel; more go to the dequantized tiles and torch's GEMM (unless
# the integer path takes them: integer_rows).
QLINEAR_MAX_ROWS = 64
TILE_BYTES = 1 << 20  # fp32 weight rows per prefill tile (L2 resident)
WHOLE_BYTES = 16 << 20  # prefill dequantizes a weight whole up to this many fp32 bytes
Q4_1, Q8_0 = QTYPES["q4_1"], QTYPES["q8_0"]
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class QDesc(ctypes.Structure):
    """quant.c's QDesc: a quantized weight as the layer loop passes it (v: its integer-path
    copy, ``integer_copy``, or NULL)."""

    _fields_ = [("w", _P), ("scale", _P), ("qt", _I32), ("v", _P)]


@functools.cache
def library(isa: str | None = None) -> ctypes.CDLL:
    """quant.c built for ``isa`` (``ISA_FLAGS``; None: ``PDSERVE_QUANT_ISA``); BuildError if it
    cannot be built."""
    return load(_SOURCE, isa or envs.quant_isa())


def load(source: Path, isa: str) -> ctypes.CDLL:
    """``source`` (quant.c or another version of it, e.g. to benchmark against) built for
    ``isa``, its entry points typed."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"PDSERVE_QUANT_ISA={isa!r}; use one of {', '.join(ISA_FLAGS)}")
    lib = load_library(source, ISA_FLAGS[isa])
    lib.pdserve_qlinear.argtypes = [_P, _P, _I32, _P, _P, _P, _I64, _I64, _I64, _I32, _I32]
    lib.pdserve_qlinear.restype = ctypes.c_int
    lib.pdserve_qdequant.argtypes = [_P, _I32, _P, _P, _I64, _I64, _I64, _P, _I32]
    lib.pdserve_qdequant.restype = ctypes.c_int
    for fn in (lib.pdserve_qlinear_desc, lib.pdserve_qlinear_desc_f32):
        fn.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _I32]
        fn.restype = None
    lib.pdserve_qv_available.restype = ctypes.c_int
    lib.pdserve_qv_max_rows.restype = _I64
    lib.pdserve_qv_bytes.argtypes = [_I64, _I64, _I32]
    lib.pdserve_qv_bytes.restype = _I64
    lib.pdserve_qv_pack.argtypes = [_P, _I64, _I64, _I32, _P, _I32]
    lib.pdserve_qv_pack.restype = ctypes.c_int
    lib.pdserve_qlinear_v.argtypes = [_P, _P, _I32, _P, _P, _I64, _I64, _I64, _I32]
    lib.pdserve_qlinear_v.restype = ctypes.c_int
    return lib


def isa_of(lib: ctypes.CDLL) -> str:
    """The instruction set a build of quant.c holds: "avx512", "avx2" or "portable"."""
    return ISA_CODES[lib.pdserve_quant_isa()]


def available() -> bool:
    try:
        library()
        return True
    except BuildError:
        return False


def _scale_ptr(w: QuantizedWeight) -> int | None:
    return None if w.scale is None else w.scale.data_ptr()


def dequantize_rows(
    w: QuantizedWeight,
    first: int,
    n: int,
    out: torch.Tensor,
    ids: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Rows ``first .. first+n-1`` (or ``ids``, int64) of ``w`` dequantized into fp32 ``out``."""
    lib = lib or library()
    rc = lib.pdserve_qdequant(
        w.data.data_ptr(),
        w.qtype,
        _scale_ptr(w),
        None if ids is None else ids.data_ptr(),
        first,
        n,
        w.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"quantized format {w.qtype} with K = {w.shape[1]} is not supported")
    return out


def embedding(ids: torch.Tensor, w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of ``w`` (the embedding lookup of a quantized, tied embedding)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < w.shape[0]):
        raise IndexError(f"token id out of range [0, {w.shape[0]})")
    out = torch.empty(flat.numel(), w.shape[1], dtype=torch.float32)
    dequantize_rows(w, 0, flat.numel(), out, flat)
    return out.to(dtype).reshape(*ids.shape, w.shape[1])


def _tiled(x2: torch.Tensor, w: QuantizedWeight, lib: ctypes.CDLL) -> torch.Tensor:
    """x2 [M, K] (fp32) @ dequant(w)^T as a contiguous fp32 [M, N]: the whole weight dequantized
    into one buffer and one GEMM when it takes at most WHOLE_BYTES as fp32 (every projection of
    the default model), else by tiles of TILE_BYTES of weight rows (a large lm_head). The result
    is row-major like a dense linear's: a transposed view made prefill attention, which reads it
    by rows, 1.6x slower at 768 tokens (AVX2 Zen 3, 1 thread)."""
    n, k = w.shape
    rows = n if 4 * n * k <= WHOLE_BYTES else max(16, TILE_BYTES // (4 * k))
    buf = torch.empty(min(rows, n), k, dtype=torch.float32)
    if rows >= n:
        return torch.mm(x2, dequantize_rows(w, 0, n, buf, lib=lib).T)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        r = min(rows, n - n0)
        y[:, n0 : n0 + r] = torch.mm(x2, dequantize_rows(w, n0, r, buf[:r], lib=lib).T)
    return y


def linear(
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``x @ dequant(w).T + bias`` for fp32 or bf16 x (y in x's dtype)."""
    lib = lib or library()
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu:
        y = x @ w.dequantize(x.dtype).T
        return y if bias is None else y + bias
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    v = integer_copy(w, lib) if x.dtype == torch.float32 and m <= integer_rows(lib) else None
    if m > QLINEAR_MAX_ROWS and v is None:
        y = _tiled(x2.float(), w, lib)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    if v is not None and not lib.pdserve_qlinear_v(
        x2.data_ptr(),
        v.data_ptr(),
        w.qtype,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    ):
        return y.reshape(*x.shape[:-1], n)
    rc = lib.pdserve_qlinear(
        x2.data_ptr(),
        w.data.data_ptr(),
        w.qtype,
        _scale_ptr(w),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("quantized linear: the C kernel could not allocate its scratch memory")
    if rc:
        raise ValueError(f"quantized format {w.qtype} with K = {k} is not supported")
    return y.reshape(*x.shape[:-1], n)


def descriptor(w: QuantizedWeight) -> QDesc:
    """What the layer loop passes for ``w`` in place of a packed weight (keep ``w`` alive)."""
    v = integer_copy(w)
    return QDesc(w.data.data_ptr(), _scale_ptr(w), w.qtype, None if v is None else v.data_ptr())


# id(weight) -> (a weak reference to it, the width of the build it was made for, its copy in
# quant_int.h's layout)
_integer: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def integer_rows(lib: ctypes.CDLL | None = None) -> int:
    """The most rows of fp32 x the build's integer path takes (``quant_int.h``'s QV_MAX_ROWS:
    every count with AVX-512 VNNI, 8 with AVX2), 0 where it has none."""
    return _integer_rows(lib or library())


@functools.cache
def _integer_rows(lib: ctypes.CDLL) -> int:  # asked on every linear call: once per build
    return int(lib.pdserve_qv_max_rows()) if _integer_width(lib) else 0


@functools.cache
def _integer_width(lib: ctypes.CDLL) -> int:
    """The build's integer path (512: AVX-512 VNNI, 256: AVX2), 0 without one or when
    ``PDSERVE_QUANT_INTEGER=0``."""
    return int(lib.pdserve_qv_available()) if envs.quant_integer() else 0


def integer_copy(w: QuantizedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """``w``'s blocks repacked for the integer path (``quant_int.h``: fp32 x, up to
    ``integer_rows`` rows; Q4_1 with AVX2 or AVX-512 VNNI, Q8_0 with AVX-512 VNNI), made on first
    use and dropped with ``w``; None where the build has no such path for ``w``'s format
    (``PDSERVE_QUANT_ISA``, the CPU, ``PDSERVE_QUANT_INTEGER=0``) or N % 16 != 0. The blocks stay
    too: the float paths and the embedding lookup read them."""
    lib = lib or library()
    width = _integer_width(lib)
    if w.qtype not in (Q4_1, Q8_0) or not width:
        return None
    entry = _integer.get(id(w))
    if entry is not None and entry[0]() is w and entry[1] == width:  # not another build's
        return entry[2]
    n, k = w.shape
    size = lib.pdserve_qv_bytes(n, k, w.qtype)
    if size < 0:
        return None
    v = memory.weights_empty(size, torch.uint8)  # read by every small step: huge pages
    lib.pdserve_qv_pack(w.data.data_ptr(), n, k, w.qtype, v.data_ptr(), torch.get_num_threads())
    key = id(w)
    _integer[key] = (weakref.ref(w, lambda _, key=key: _integer.pop(key, None)), width, v)
    return v
