"""Quantized weights: the plain-torch dequantization against the ``gguf`` package's, and every
build of ``quant.c`` (portable, AVX2, AVX-512) against the plain-torch one.

Dequantized weights must be bit for bit equal (each value is one product and, for Q4_1, one sum,
rounded as fp32); linear outputs are held to the rounding of an fp32 sum of K terms against
float64 sums of the same dequantized weights. The AVX2 build runs wherever the CPU has AVX2 (it
is compiled with -mno-avx512f, so it is tested on AVX-512 machines too), the AVX-512 build only
where the CPU has AVX-512 F+BW; the portable build runs everywhere.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from pdserve.kernels import quantized as Q
from pdserve.kernels import reference
from pdserve.kernels.cpu import quant

from pdserve import envs

FORMATS = ["q4_0", "q4_1", "q8_0", "int8"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
ISA = envs.cpu_isa()  # PDSERVE_CPU_ISA: no build is wider
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS and ISA != "portable"
HAS_AVX512 = HAS_AVX2 and {"avx512f", "avx512bw"} <= FLAGS and ISA == "native"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
ISAS = [  # (build, the instruction set it must report)
    pytest.param("portable", "portable", id="portable"),
    pytest.param(
        "avx2",
        "avx2",
        id="avx2",
        marks=pytest.mark.skipif(not HAS_AVX2, reason="CPU without AVX2+FMA+F16C"),
    ),
    pytest.param(
        "native",
        "avx512",
        id="avx512",
        marks=pytest.mark.skipif(not HAS_AVX512, reason="CPU without AVX-512 F+BW"),
    ),
]


def make_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Normal values with a few large ones per row (outliers set the block scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, ::37] *= 6
    if n > 2:
        w[1] = 0.0  # an all-zero row: int8's scale must not divide by zero
    return w


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_torch_dequantization_matches_gguf_package(name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qw = Q.quantize(make_weight(40, 96), name)
    theirs = dequantize(qw.data.numpy(), GGMLQuantizationType(qw.qtype))
    assert torch.equal(Q.dequantize_reference(qw), torch.from_numpy(np.asarray(theirs)))


def test_block_layout_by_hand():
    """One Q4_1 row of one block written by hand: d = 0.5, m = -1, nibbles 0..15 low, 15..0 high."""
    block = bytearray(np.array([0.5, -1.0], dtype=np.float16).tobytes())
    block += bytes((j | ((15 - j) << 4)) for j in range(16))
    qw = Q.QuantizedWeight(torch.tensor(list(block), dtype=torch.uint8)[None], 3, (1, 32))
    want = [j * 0.5 - 1 for j in range(16)] + [(15 - j) * 0.5 - 1 for j in range(16)]
    assert Q.dequantize_reference(qw)[0].tolist() == want


def test_int8_is_symmetric_per_channel():
    w = make_weight(33, 64)
    qw = Q.quantize_int8(w)
    q = qw.data.view(torch.int8).to(torch.float32)
    assert torch.equal(q.abs().amax(1)[w.abs().amax(1) > 0], torch.full((32,), 127.0))
    assert float(qw.scale[1]) == 1.0 and not q[1].any()  # the zero row
    err = (Q.dequantize_reference(qw) - w).abs()
    assert bool((err <= qw.scale[:, None] / 2 * (1 + 1e-6)).all())  # round to nearest


@needs_cc
@pytest.mark.parametrize("isa,reports", ISAS)
@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_rows_exact(isa, reports, name):
    lib = quant.library(isa)
    assert quant.isa_of(lib) == reports
    qw = Q.quantize(make_weight(67, 160, seed=1), name)
    ref = Q.dequantize_reference(qw)
    out = torch.empty(67, 160)
    quant.dequantize_rows(qw, 0, 67, out, lib=lib)
    assert torch.equal(out, ref)
    ids = torch.tensor([5, 0, 66, 5], dtype=torch.int64)
    picked = torch.empty(4, 160)
    quant.dequantize_rows(qw, 0, 4, picked, ids, lib=lib)
    assert torch.equal(picked, ref[ids])


def assert_fp32_sum_close(y: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, k: int) -> None:
    """fp32 sums of k products: error within a few ulps of sqrt(k) times the largest partial
    magnitude (``terms`` = sum_k |x w|). bf16 outputs: half a bf16 ulp more."""
    eps = torch.finfo(torch.float32).eps
    tol = 4 * math.sqrt(k) * eps * terms + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    bad = (y.double() - ref).abs() > tol
    assert not bool(bad.any()), (
        f"{int(bad.sum())} outputs off, worst {(y.double() - ref).abs().max()}"
    )


@needs_cc
@pytest.mark.parametrize("isa,reports", ISAS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(301, 576), (37, 1376)], ids=["K576", "K1376"])
def test_linear_within_fp32_rounding(isa, reports, name, dtype, n, k):
    """Every row count of the direct path's passes (1-8), the tiled C path (9-64, odd counts for
    partial passes) and the dequantized-tile GEMM above QLINEAR_MAX_ROWS; N not a multiple of the
    tiled path's weight rows per tile (4; AVX2 6: its partial tile) and several chunks per thread.
    K 1376 (43 blocks) takes the tiled path's k in uneven chunks (AVX2 15 + 15 + 13 blocks,
    AVX-512 and portable 22 + 21), the sums carried from one to the next."""
    lib = quant.library(isa)
    qw = Q.quantize(make_weight(n, k, seed=2), name)
    w64 = Q.dequantize_reference(qw).double()
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=g).to(dtype)
    for m in [*range(1, 10), 17, 33, 64, quant.QLINEAR_MAX_ROWS + 7]:
        x = torch.randn(m, k, generator=g).to(dtype)
        for b in (None, bias):
            y = quant.linear(x, qw, b, lib=lib)
            assert y.dtype == dtype and y.shape == (m, n)
            ref = x.double() @ w64.T
            terms = x.double().abs() @ w64.abs().T
            if b is not None:
                ref = ref + b.double()
            assert_fp32_sum_close(y, ref, terms, k)


@needs_cc
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "tiles"])
def test_prefill_path_is_row_major_whole_and_by_tiles(monkeypatch, whole):
    """Above QLINEAR_MAX_ROWS the weight is dequantized whole (up to WHOLE_BYTES) or by tiles of
    rows (here 64 rows: 4 full tiles and a partial one); either way the output is row-major like
    a dense linear's (a transposed result slowed prefill attention 1.6x) and within fp32 rounding."""
    n, k, m = 301, 576, quant.QLINEAR_MAX_ROWS + 36
    if not whole:
        monkeypatch.setattr(quant, "WHOLE_BYTES", 0)
        monkeypatch.setattr(quant, "TILE_BYTES", 64 * 4 * k)
    qw = Q.quantize(make_weight(n, k, seed=6), "q4_1")
    w64 = Q.dequantize_reference(qw).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    y = quant.linear(x, qw)
    assert y.shape == (m, n) and y.is_contiguous()
    assert_fp32_sum_close(y, x.double() @ w64.T, x.double().abs() @ w64.abs().T, k)


@needs_cc
@pytest.mark.parametrize("isa,reports", ISAS)
@pytest.mark.parametrize("name", FORMATS)
def test_direct_path_tails(isa, reports, name):
    """The direct path's partial pieces: K of 1, 16, 17 and 65 blocks (scales converted 16 blocks
    at a time: partial groups; 4 blocks in flight per row: partial unrolls), N around the weight rows
    one row of x runs side by side (4; portable 2: N % 4 of 0-3), one and two rows of
    x, one and two threads (chunks of rows whose ends are not multiples of 4)."""
    lib = quant.library(isa)
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for k, n, t in [(32, 1, 1), (32, 7, 1), (512, 4, 1), (544, 5, 1), (2080, 3, 1),
                        (2080, 9, 1), (2080, 67, 2), (544, 301, 2)]:  # fmt: skip
            torch.set_num_threads(t)
            qw = Q.quantize(make_weight(n, k, seed=k + n), name)
            w64 = Q.dequantize_reference(qw).double()
            for m in (1, 2):
                x = torch.randn(m, k, generator=g)
                y = quant.linear(x, qw, lib=lib)
                ref = x.double() @ w64.T
                assert_fp32_sum_close(y, ref, x.double().abs() @ w64.abs().T, k)
    finally:
        torch.set_num_threads(threads)


@needs_cc
def test_backend_linear_and_embedding_take_quantized_weights():
    """The CPU backend's ``linear`` sends a QuantizedWeight to quant.c; the reference backend
    dequantizes; the embedding lookup gives the dequantized rows exactly."""
    from pdserve.kernels import cpu

    qw = Q.quantize(make_weight(64, 96, seed=4), "q4_1")
    x = torch.randn(3, 96)
    ours, ref = cpu.linear(x, qw), reference.linear(x, qw)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    ids = torch.tensor([[3, 63], [0, 3]])
    for dtype in (torch.float32, torch.bfloat16):
        got = cpu.quantized_embedding(ids, qw, dtype)
        assert got.shape == (2, 2, 96) and got.dtype == dtype
        assert torch.equal(got, reference.quantized_embedding(ids, qw, dtype))
    with pytest.raises(IndexError):
        cpu.quantized_embedding(torch.tensor([64]), qw, torch.float32)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="K % 32"):
        Q.QuantizedWeight(torch.zeros(2, 18, dtype=torch.uint8), 2, (2, 16))
    with pytest.raises(ValueError, match="uint8"):
        Q.QuantizedWeight(torch.zeros(2, 17, dtype=torch.uint8), 2, (2, 32))
    with pytest.raises(ValueError, match="per-row scale"):
        Q.QuantizedWeight(torch.zeros(2, 32, dtype=torch.uint8), 100, (2, 32))
