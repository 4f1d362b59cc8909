"""quant.c's integer path (``quant_int.h``: Q4_1 weights, fp32 x; AVX-512 VNNI or AVX2): its
layout against GGUF's blocks, its outputs against float64 sums of the dequantized weights, and
where it is and is not taken. Both builds that have it run wherever the CPU can (the AVX2 one,
-mno-avx512f, on AVX-512 machines too); the portable build has none.

Its error bound: an fp32 sum's rounding (as test_quant.py holds the float path to) plus the
representation of x, each value within 2^-22 of its block's largest magnitude.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from pdserve.kernels import quantized as Q
from pdserve.kernels.cpu import quant

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _width(isa: str) -> int:
    """The integer path's vector width in ``isa``'s build of quant.c (0: none, or no build)."""
    try:
        return quant.library(isa).pdserve_qv_available()
    except quant.BuildError:
        return 0


HAS_AVX2 = shutil.which("cc") is not None and _width("avx2") == 256
needs_int = pytest.mark.skipif(
    shutil.which("cc") is None or not _width("native"),
    reason="no integer path in this CPU's build of quant.c (needs AVX2 or AVX-512)",
)
BUILDS = [
    pytest.param("native", id="native", marks=needs_int),
    pytest.param(
        "avx2", id="avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="CPU without AVX2")
    ),
]


def make_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, ::37] *= 6
    return w


def unpack(v: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight in quant_int.h's layout, dequantized in plain torch (q d + m, fp32)."""
    g = v.view(n // 16, k // 32, 320)
    d = g[..., :32].contiguous().view(torch.float16).float()  # [groups, blocks, 16]
    m = g[..., 32:64].contiguous().view(torch.float16).float()
    runs = g[..., 64:].reshape(n // 16, k // 32, 4, 16, 4).long()  # run c, row r, byte j
    q = torch.empty(n // 16, k // 32, 16, 32, dtype=torch.long)
    for c in range(4):
        for j in range(4):
            q[:, :, :, 8 * c + j] = runs[:, :, c, :, j] & 15
            q[:, :, :, 8 * c + 4 + j] = runs[:, :, c, :, j] >> 4
    w = q.float() * d[..., None] + m[..., None]  # [groups, blocks, rows, 32]
    return w.permute(0, 2, 1, 3).reshape(n, k)


def unpack8(v: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The same for Q8_0's layout (q d)."""
    g = v.view(n // 16, k // 32, 544)
    d = g[..., :32].contiguous().view(torch.float16).float()
    q = g[..., 32:].contiguous().view(torch.int8).reshape(n // 16, k // 32, 8, 16, 4)
    q = q.permute(0, 1, 3, 2, 4).reshape(n // 16, k // 32, 16, 32).float()  # row r, k = 4c + j
    return (q * d[..., None]).permute(0, 2, 1, 3).reshape(n, k)


Q8_ON_512 = pytest.mark.skipif(
    shutil.which("cc") is None or _width("native") != 512,
    reason="Q8_0's integer path needs AVX-512 VNNI",
)


@pytest.mark.parametrize(
    "name,bytes_per_block",
    [pytest.param("q4_1", 20, marks=needs_int), pytest.param("q8_0", 34, marks=Q8_ON_512)],
)
def test_layout_holds_the_blocks_exactly(name, bytes_per_block):
    n, k = 48, 96
    qw = Q.quantize(make_weight(n, k, 1), name)
    v = quant.integer_copy(qw)
    assert v is not None and v.numel() == bytes_per_block * n * k // 32
    back = (unpack if name == "q4_1" else unpack8)(v, n, k)
    assert torch.equal(back, Q.dequantize_reference(qw))


def assert_within_bound(
    y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, k: int, d: torch.Tensor | None = None
) -> None:
    """fp32 rounding of a k-term sum (test_quant.py's bound) plus x's representation: each x
    value within 2^-22 of the largest |x| of its block of 32. Q8_0 (``d``: its [N, K / 32]
    scales): plus the rounding of the block sums of (q + 128) x, a few ulps of 256 d sum |x|."""
    eps = torch.finfo(torch.float32).eps
    xd = x.double()
    ref = xd @ w64.T
    fp32 = 4 * math.sqrt(k) * eps * (xd.abs() @ w64.abs().T)
    block_max = xd.abs().view(x.shape[0], k // 32, 32).amax(-1)  # [m, blocks]
    wabs = w64.abs().view(w64.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    tol = fp32 + 2.0**-22 * (block_max @ wabs.T) + 1e-30
    if d is not None:
        xsum = xd.abs().view(x.shape[0], k // 32, 32).sum(-1)
        tol = tol + 2.0**-21 * (xsum @ (256 * d.double()).T)
    err = (y.double() - ref).abs()
    assert not bool((err > tol).any()), f"{int((err > tol).sum())} outputs off, worst {err.max()}"


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_outputs_within_fp32_rounding_and_x_representation(isa, threads, name):
    """Every row count up to 8 (passes of 4 and partial ones) and, where the build takes more
    (AVX-512 VNNI: every count), 9, 17, 70 (a prompt's, past quant.QLINEAR_MAX_ROWS) and 131
    (past the 128 rows quant_int.h takes at a time); K of 1 to 65 blocks, 16 to 320 rows, with
    and without bias; blocks of x of very different magnitudes, an all-zero block and a block
    with one large value among tiny ones."""
    lib = quant.library(isa)
    assert lib.pdserve_qv_available() in (256, 512)
    if name == "q8_0" and lib.pdserve_qv_available() != 512:
        pytest.skip("Q8_0's integer path needs AVX-512 VNNI")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    try:
        for n, k in [(16, 32), (64, 576), (320, 1536), (32, 2080)]:
            qw = Q.quantize(make_weight(n, k, n + k), name)
            assert quant.integer_copy(qw, lib) is not None
            w64 = Q.dequantize_reference(qw).double()
            d = None
            if name == "q8_0":
                d = qw.data.view(n, k // 32, 34)[..., :2].contiguous().view(torch.float16)[..., 0]
            bias = torch.randn(n, generator=g)
            for m in [*range(1, 9), 9, 17, 70, 131]:
                if m > quant.integer_rows(lib):
                    break
                scale = 10.0 ** torch.randint(-6, 6, (m, k // 32, 1), generator=g).double()
                x = (torch.randn(m, k // 32, 32, generator=g) * scale).float().reshape(m, k)
                x[0, :32] = 0.0
                if k >= 64:
                    x[-1, 32:64] = 1e-7
                    x[-1, 40] = 3e4
                y = quant.linear(x, qw, lib=lib)
                assert y.shape == (m, n)
                assert_within_bound(y, x, w64, k, d)
                yb = quant.linear(x, qw, bias, lib=lib)
                assert torch.equal(yb, y + bias)
    finally:
        torch.set_num_threads(saved)


@needs_int
def test_taken_only_where_it_applies(monkeypatch):
    """Q4_1 with N % 16 == 0 and fp32 x, up to quant.integer_rows rows (AVX2: 8; AVX-512 VNNI:
    any, a prompt's too); other formats (Q4_0; Q8_0 without VNNI), shapes, row counts and bf16 x
    keep the float path (same outputs as its entry point gives)."""
    lib = quant.library()
    k = 96
    q41 = Q.quantize(make_weight(32, k, 5), "q4_1")
    assert quant.integer_copy(q41) is not None
    assert quant.integer_copy(q41) is quant.integer_copy(q41)  # made once
    for other in (
        Q.quantize(make_weight(30, k, 6), "q4_1"),
        Q.quantize(make_weight(32, k, 7), "q4_0"),
    ):
        assert quant.integer_copy(other) is None  # N % 16, the format
    assert quant.integer_copy(q41, lib=quant.library("portable")) is None
    q80 = Q.quantize(make_weight(32, k, 8), "q8_0")
    if quant.integer_copy(q80) is not None:  # AVX-512 VNNI: not a layout the AVX2 build has
        assert quant.integer_copy(q80, lib=quant.library("avx2")) is None

    def direct(x, w, integer):
        m, n = x.shape[0], w.shape[0]
        y = torch.empty(m, n, dtype=x.dtype)
        if integer:
            v = quant.integer_copy(w)
            rc = lib.pdserve_qlinear_v(
                x.data_ptr(), v.data_ptr(), w.qtype, None, y.data_ptr(), m, n, k, 1
            )
        else:
            bf16 = int(x.dtype == torch.bfloat16)
            rc = lib.pdserve_qlinear(
                x.data_ptr(), w.data.data_ptr(), w.qtype, None, None, y.data_ptr(), m, n, k, bf16, 1
            )
        assert rc == 0
        return y

    g = torch.Generator().manual_seed(8)
    x1 = torch.randn(1, k, generator=g)
    assert torch.equal(quant.linear(x1, q41), direct(x1, q41, integer=True))
    assert not torch.equal(direct(x1, q41, integer=True), direct(x1, q41, integer=False))
    limit = quant.integer_rows(lib)
    if limit < quant.QLINEAR_MAX_ROWS:  # AVX2: more rows take the float path
        xm = torch.randn(limit + 1, k, generator=g)
        assert torch.equal(quant.linear(xm, q41), direct(xm, q41, integer=False))
    else:  # AVX-512 VNNI: every count, a prompt's too
        xm = torch.randn(quant.QLINEAR_MAX_ROWS + 5, k, generator=g)
        assert torch.equal(quant.linear(xm, q41), direct(xm, q41, integer=True))
    xb = torch.randn(2, k, generator=g).bfloat16()
    assert torch.equal(quant.linear(xb, q41), direct(xb, q41, integer=False))


@needs_int
def test_layer_loop_descriptor_carries_the_copy():
    qw = Q.quantize(make_weight(32, 64, 9), "q4_1")
    desc = quant.descriptor(qw)
    assert desc.v == quant.integer_copy(qw).data_ptr()
    assert quant.descriptor(Q.quantize(make_weight(32, 64, 9), "q4_0")).v is None


@needs_cc
def test_the_portable_build_refuses_it():
    lib = quant.library("portable")
    assert lib.pdserve_qv_available() == 0
    x, y = torch.randn(1, 32), torch.empty(1, 16)
    assert lib.pdserve_qlinear_v(x.data_ptr(), None, 3, None, y.data_ptr(), 1, 16, 32, 1) == -2
    assert lib.pdserve_qv_bytes(16, 32, 3) == -1


@needs_int
def test_sizes_and_formats():
    lib = quant.library()
    assert lib.pdserve_qv_bytes(16, 32, 3) == 320 and lib.pdserve_qv_bytes(15, 32, 3) == -1
    assert lib.pdserve_qv_bytes(16, 48, 3) == -1 and lib.pdserve_qv_bytes(16, 32, 2) == -1
    want = 544 if lib.pdserve_qv_available() == 512 else -1
    assert lib.pdserve_qv_bytes(16, 32, 8) == want


@pytest.mark.parametrize("isa", BUILDS)
def test_non_finite_x_gives_nan_not_garbage(isa):
    lib = quant.library(isa)
    qw = Q.quantize(make_weight(16, 64, 10), "q4_1")
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    y = quant.linear(x, qw, lib=lib)
    assert bool(y.isnan().all())
