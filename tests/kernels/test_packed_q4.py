"""Q4_1 and Q8_0 weights in a bf16 model where the CPU has AVX512-BF16 (``packed_q4.h``):
multiplied from their blocks for few rows of x and from a packed bf16 copy for more.

- By default few rows take the float block kernel: bit-identical outputs either way, equal to
  the packed kernel on the bf16 rounding of the dequantized weight.
- With ``PDSERVE_BF16_INTEGER_ROWS`` (opt-in, AVX-512 VNNI) up to that many rows take quant.c's
  integer path (exact weights): each output the fp32 integer path's on x widened, rounded once
  to bf16; more rows the dense bf16 kernel's bits as before.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pdserve.kernels import quantized as Q
from pdserve.kernels.cpu import gemm, quant

from tests.kernels.test_quant import make_weight

needs_packing = pytest.mark.skipif(
    shutil.which("cc") is None or gemm._packing() is None,
    reason="no C compiler or no AVX512-BF16 (the packed kernels need it)",
)


def _dense_bf16(qw: Q.QuantizedWeight) -> torch.Tensor:
    return Q.dequantize_reference(qw).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(301, 576), (960, 576), (224, 576), (64, 1536), (7, 32)])
def test_every_row_count_gives_the_dense_bf16_kernels_bits(name, n, k):
    """Row counts on both sides of HYBRID_MAX_ROWS, partial passes of the 4-bit kernel, 1 to 4
    groups of 16 outputs side by side (19, 60, 14, 4 or 1 groups split between threads), N not a
    multiple of 16, with and without bias: the same bits as the packed kernel on the dequantized
    weight rounded to bf16 (the same vdpbf16ps chain per output)."""
    qw = Q.quantize(make_weight(n, k, seed=5), name)
    desc = gemm.hybrid_weight(qw)
    assert desc is not None and not desc.small  # the integer path only where asked for
    dense = _dense_bf16(qw)
    g = torch.Generator().manual_seed(6)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    rows = [*range(1, gemm.HYBRID_MAX_ROWS + 3), 17, 100]
    for m in rows:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = gemm.linear(x, qw, b)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.equal(got, gemm.linear(x, dense, b)), (m, b is None)


@needs_packing
def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    """What makes the choice by row count safe: a token's outputs do not depend on its batch."""
    n, k = 576, 1536
    qw = Q.quantize(make_weight(n, k, seed=7), "q4_1")
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    batch = gemm.linear(x, qw)
    for i in (0, 5, 39):
        assert torch.equal(gemm.linear(x[i : i + 1], qw), batch[i : i + 1])
        assert torch.equal(gemm.linear(x[i : i + 3], qw), batch[i : i + 3])


@needs_packing
@pytest.mark.parametrize("integer", [False, True])
def test_thread_count_does_not_change_the_bits(request, integer):
    if integer:
        request.getfixturevalue("bf16_integer_rows")
    qw = Q.quantize(make_weight(960, 576, seed=9), "q4_1")
    assert gemm.hybrid_weight(qw) is not None
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, qw)
        torch.set_num_threads(2)
        two = gemm.linear(x, qw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


needs_integer = pytest.mark.skipif(
    shutil.which("cc") is None
    or gemm._packing() is None
    or quant.integer_bf16(Q.quantize(torch.ones(16, 32), "q4_1")) is None,
    reason="no AVX512-BF16 with AVX-512 VNNI (the hybrid's integer path)",
)


@needs_integer
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 1536), (16, 32)])
def test_few_rows_take_the_integer_path_rounded_once(bf16_integer_rows, name, n, k):
    """With PDSERVE_BF16_INTEGER_ROWS (2), up to that many rows of bf16 x: the fp32 integer
    path's outputs on x widened (bias
    too), each rounded once to bf16, so within the integer path's bound of the exact product plus
    half a bf16 ulp (exact weights: no bf16 rounding of them); more rows: the dense bf16 kernel's
    bits, from the float block kernel up to HYBRID_MAX_ROWS and from the packed copy beyond."""
    qw = Q.quantize(make_weight(n, k, seed=21), name)
    desc = gemm.hybrid_weight(qw)
    assert desc is not None and desc.small and desc.v and desc.qp
    assert desc.small_max_rows == bf16_integer_rows < gemm.HYBRID_MAX_ROWS == desc.qp_max_rows
    dense = _dense_bf16(qw)
    g = torch.Generator().manual_seed(22)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    for m in [*range(1, gemm.HYBRID_MAX_ROWS + 3), 33]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = gemm.linear(x, qw, b)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            if m <= bf16_integer_rows:
                fp32 = quant.linear(x.float(), qw, None if b is None else b.float())
                assert torch.equal(got, fp32.bfloat16()), (m, b is None)
            else:  # the float block kernel (up to HYBRID_MAX_ROWS) or the packed copy: its bits
                assert torch.equal(got, gemm.linear(x, dense, b)), (m, b is None)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ Q.dequantize_reference(qw).double().T
    scale = x.double().abs() @ Q.dequantize_reference(qw).double().abs().T
    err = (gemm.linear(x, qw).double() - exact).abs()
    assert bool((err <= 2.0**-8 * exact.abs() + 1e-5 * scale).all())


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


def test_bf16_integer_rows_setting_names_what_is_allowed(monkeypatch):
    from pdserve import envs

    assert envs.bf16_integer_rows() == 0
    for bad in ("9", "-1", "two"):
        monkeypatch.setenv("PDSERVE_BF16_INTEGER_ROWS", bad)
        with pytest.raises(ValueError, match="from 0 to 8"):
            envs.bf16_integer_rows()
