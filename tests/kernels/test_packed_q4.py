"""Q4_1 and Q8_0 weights in a bf16 model where the CPU has AVX512-BF16 (``packed_q4.h``): no
output depends on how many rows a step batches.

- A prompt's rows (``gemm.linear``) on the bf16 rounding of the dequantized weights, from the
  blocks for few rows and a packed copy for more: the packed dense bf16 kernel's bits.
- A generated token's rows (``gemm.linear_rows``) on Q4_1's exact values (``exact_q4.h``: 128 + q
  as bf16, the block's d and m applied once per block): each output the exact product rounded
  once to bf16 but for the fp32 sums' rounding, the same bits at every row count.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pdserve.kernels import quantized as Q
from pdserve.kernels.cpu import build, gemm

from tests.kernels.test_quant import FLAGS, make_weight

needs_packing = pytest.mark.skipif(
    shutil.which("cc") is None or gemm._packing() is None,
    reason="no C compiler or no AVX512-BF16 (the packed kernels need it)",
)

# Row counts on both sides of the few-rows limit (8) and of a generated run (128), partial passes
# of 8 rows, 1 to 4 groups of 16 outputs side by side.
ROWS = [*range(1, 11), 17, 100, 127, 128, 129, 200]
SHAPES = [(301, 576), (960, 576), (224, 576), (64, 1536), (7, 32), (33, 64)]


def _dense_bf16(qw: Q.QuantizedWeight) -> torch.Tensor:
    return Q.dequantize_reference(qw).to(torch.bfloat16)


def _generated(x, qw, bias=None):
    return gemm.linear_rows(x, qw, bias, 0)


def _batch_and_slices(qw, k, bias, seed, linear=gemm.linear):
    """One batch of max(ROWS) rows of x; for each row count, its slices at two offsets: (the rows
    of x, their outputs alone, the same rows' outputs in the batch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(ROWS), k, generator=g).to(torch.bfloat16)
    batch = linear(x, qw, bias)
    assert batch.dtype == torch.bfloat16 and batch.shape == (max(ROWS), qw.shape[0])
    for m in ROWS:
        for start in (0, max(ROWS) - m):
            rows = x[start : start + m]
            yield rows, linear(rows, qw, bias), batch[start : start + m]


@needs_packing
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_row_count_gives_the_dense_bf16_kernels_bits(name, n, k):
    """A prompt's rows: the same bits as the packed kernel on the dequantized weight rounded to
    bf16 (the same vdpbf16ps chain per output), from the blocks or the copy, alone or in a batch,
    with and without bias, N not a multiple of 16. Q8_0 multiplies a generated token's rows so
    too."""
    qw = Q.quantize(make_weight(n, k, seed=5), name)
    desc = gemm.hybrid_weight(qw)
    assert desc is not None and desc.qp_max_rows == gemm.HYBRID_MAX_ROWS
    assert gemm.hybrid_tier(qw) == (8, gemm.hybrid_tier(qw)[1], name == "q4_1")
    dense = _dense_bf16(qw)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for b in (None, bias):
        for x, got, want in _batch_and_slices(qw, k, b, seed=7):
            assert torch.equal(got, want), (len(x), b is None)
            assert torch.equal(got, gemm.linear(x, dense, b)), (len(x), b is None)
            if name == "q8_0" and len(x) in (3, 17):
                assert torch.equal(gemm.linear_rows(x, qw, b, 1), got)


@needs_packing
@pytest.mark.parametrize("n,k", SHAPES)
def test_generated_rows_of_q4_1_do_not_depend_on_the_step(n, k):
    """A generated token's row gives the same bits alone, among few rows or many (runs of 128),
    and after any number of a prompt's rows in its step, with and without bias, N not a multiple
    of 16; the prompt's rows there are the prompt kernels' bits."""
    qw = Q.quantize(make_weight(n, k, seed=5), "q4_1")
    desc = gemm.hybrid_weight(qw)
    assert desc is not None and desc.qx and desc.qt == Q.QTYPES["q4_1"]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for b in (None, bias):
        for x, got, want in _batch_and_slices(qw, k, b, seed=7, linear=_generated):
            assert torch.equal(got, want), (len(x), b is None)
            for p in {1, len(x) // 2, len(x) - 1} - {0}:
                mixed = gemm.linear_rows(x, qw, b, p)
                assert torch.equal(mixed[:p], gemm.linear(x[:p], qw, b)), (len(x), p)
                assert torch.equal(mixed[p:], got[p:]), (len(x), p)


@needs_packing
@pytest.mark.parametrize("exact", [True, False], ids=["generated", "prompt"])
@pytest.mark.parametrize("m", [1, 3, 200])
def test_generated_rows_of_q4_1_are_the_exact_product_rounded_once(exact, m):
    """Against the exact product (fp64) with the exact dequantized weights: for a generated
    token's rows at least 99 % of the outputs are it rounded to bf16 (measured 99.8-99.9 %), the
    rest within the fp32 sums' rounding; a prompt's (the weights' bf16 rounding) ~57 %."""
    n, k = 576, 1536
    qw = Q.quantize(make_weight(n, k, seed=8), "q4_1")
    assert gemm.hybrid_weight(qw) is not None
    w = Q.dequantize_reference(qw).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    exact_y = x.double() @ w.T
    got = _generated(x, qw) if exact else gemm.linear(x, qw)
    share = float((got == exact_y.to(torch.bfloat16)).double().mean())
    if not exact:
        assert share < 0.7
        return
    assert share >= 0.99
    scale = x.double().abs() @ w.abs().T
    err = (got.double() - exact_y).abs()
    assert bool((err <= 2.0**-8 * exact_y.abs() + 2.0**-20 * scale).all())


@needs_packing
@pytest.mark.parametrize("exact", [False, True], ids=["prompt", "generated"])
def test_thread_count_does_not_change_the_bits(exact):
    linear = _generated if exact else gemm.linear
    qw = Q.quantize(make_weight(960, 576, seed=9), "q4_1")
    assert gemm.hybrid_weight(qw) is not None
    for m in (3, 200):  # the blocks, the copy
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = linear(x, qw)
            torch.set_num_threads(2)
            two = linear(x, qw)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two), m


@needs_packing
def test_other_formats_and_fp32_x_keep_the_quantized_kernels():
    """Only Q4_1 and Q8_0 get the bf16 copy (the default GGUF's formats; a Q4_0 or int8 weight
    keeps quant.c); fp32 x is multiplied with the exact 4-bit values as before."""
    for name in ("q4_0", "int8"):
        assert gemm.hybrid_weight(Q.quantize(make_weight(64, 96, seed=11), name)) is None
    qw = Q.quantize(make_weight(64, 96, seed=12), "q4_1")
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(13))
    exact = x.double() @ Q.dequantize_reference(qw).double().T
    torch.testing.assert_close(gemm.linear(x, qw).double(), exact, atol=1e-4, rtol=1e-5)


@needs_packing
@pytest.mark.skipif("avx512_vbmi2" not in FLAGS, reason="no AVX512-VBMI2: the one build there is")
def test_generated_rows_without_vbmi2_are_the_same_bits(tmp_path, monkeypatch):
    """exact_q4.h takes each word's top nibble in one vpshldw where there is VBMI2 (Zen 4, Ice
    Lake); a CPU with AVX512-BF16 but no VBMI2 (Cooper Lake) shifts and masks it as the other
    three. Both builds side by side: the same bits, one row and many, with a bias."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    lib = build.load_library(gemm._SOURCE, extra_flags=("-mno-avx512vbmi2",))
    n, k = 301, 576
    bias = torch.randn(n, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    x = torch.randn(129, k, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    native = Q.quantize(make_weight(n, k, seed=16), "q4_1")
    want = [_generated(x[:m], native, bias) for m in (1, 2, 129)]
    narrow = Q.quantize(make_weight(n, k, seed=16), "q4_1")
    monkeypatch.setattr(gemm, "_packing", lambda: gemm._Packing(lib))
    assert gemm.hybrid_weight(narrow) is not None
    for m, y in zip((1, 2, 129), want, strict=True):
        assert torch.equal(_generated(x[:m], narrow, bias), y), m
