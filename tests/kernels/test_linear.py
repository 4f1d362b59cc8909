"""``linear(x, weight, bias)`` of every backend; the CPU backend's C kernels in detail.

The AVX2 kernel tiles 4 weight rows x 2 rows of x over 8-wide k steps; the packed bf16 kernel
(AVX512-BF16) takes 64 outputs x up to 6 rows of x over pairs of k. The shapes below cover every
tail of both: N % 4 != 0 and N % 64 != 0, K % 8 != 0 and odd K, row counts that split into
uneven passes. Expected values come from float64.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from pdserve.kernels import reference
from pdserve.kernels.cpu import build, gemm, ops

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None or not gemm.linear_available(),
    reason="the C linear kernel did not build here (or has no AVX2 path); cpu uses F.linear",
)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [  # (K, N)
    pytest.param((20, 9), id="K20-N9"),  # K: 2 steps of 8 + 4; N: 2 tiles of 4 + 1
    pytest.param((577, 33), id="K577-N33"),
    pytest.param((8, 4), id="K8-N4"),  # no tails
    pytest.param((3, 7), id="K3-N7"),  # K below one step
    pytest.param((576, 962), id="K576-N962"),  # several chunks per thread, N % 4 == 2
    pytest.param(
        (96, 577), id="K96-N577"
    ),  # packed: 10 blocks, the last of 1 output; threads share blocks by rows
]


def row_counts(dtype: torch.dtype) -> list[int]:
    """Every row count up to 32 (all pass splits and tails, bf16 tiles widened from 15 rows on),
    then a few up to the threshold."""
    top = gemm.LINEAR_MAX_ROWS[dtype]
    return [m for m in [*range(1, 33), 48, 127, top] if m <= top]


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def assert_linear_close(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """fp32: the rounding error of a k-term sum grows like sqrt(k) ulps (outputs here are ~1).
    bf16: one rounding of the output to 8 significant bits, i.e. half a bf16 ulp (2^-8) relative,
    plus the fp32 sum's error where the output is near zero."""
    if y.dtype == torch.float32:
        tol = 4 * math.sqrt(k) * torch.finfo(torch.float32).eps
        torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
    else:
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=2**-8)


def make(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """x [m, k], weight [n, k] scaled so outputs are ~1, bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


@pytest.fixture
def c_only(monkeypatch):
    """gemm.linear may not fall back to F.linear: proves the C kernel produced the result."""

    def no_torch(*args, **kwargs):
        raise AssertionError("gemm.linear fell back to F.linear")

    monkeypatch.setattr(gemm, "F", SimpleNamespace(linear=no_torch))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_c_linear_matches_float64(dtype, shape, bias, c_only):
    k, n = shape
    for m in row_counts(dtype):
        x, weight, b = make(m, k, n, dtype, bias, seed=m)
        y = gemm.linear(x, weight, b)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_linear_close(y, expected(x, weight, b), k)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_and_columns_land_in_place(dtype, c_only):
    """One-hot rows of x pick single weight entries, all distinct integers (exact in bf16):
    y[m, n] must be exactly weight[n, pick[m]]; x = 0 leaves exactly the bias."""
    k, n = 20, 9
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k).to(dtype)
    bias = torch.arange(n, dtype=torch.float32).mul(-3).to(dtype)
    for m in (1, 3, 16, gemm.LINEAR_MAX_ROWS[dtype]):
        pick = [(7 * i + 3) % k for i in range(m)]
        x = torch.zeros(m, k, dtype=dtype)
        x[torch.arange(m), pick] = 1
        assert torch.equal(gemm.linear(x, weight), weight[:, pick].T)
        y = gemm.linear(torch.zeros(m, k, dtype=dtype), weight, bias)
        assert torch.equal(y, bias.expand(m, n))


@needs_kernel
def test_bf16_output_rounds_to_nearest_even_like_torch(c_only):
    """Small integers times multiples of 2^-8 sum exactly in fp32, so the only rounding is to
    bf16 at the end; it must be torch's (ties to even) bit for bit, ties included."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = gemm.LINEAR_MAX_ROWS[torch.bfloat16], 577, 401
    x = torch.randint(-8, 9, (m, k), generator=gen).to(torch.bfloat16)
    weight = (torch.randint(-255, 256, (n, k), generator=gen) / 256).to(torch.bfloat16)
    exact = expected(x, weight, None)
    assert torch.equal(exact.float().double(), exact)  # the fp32 sum is exact
    assert torch.equal(gemm.linear(x, weight), exact.float().to(torch.bfloat16))

    # 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bf16 neighbours: both go to the even one
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    weight = torch.tensor([[1.0, 2**-8], [1.0, 3 * 2**-8]], dtype=torch.bfloat16)
    assert gemm.linear(x, weight).float().tolist() == [[1.0, 1 + 2**-6]]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_are_rows(dtype, c_only):
    x, weight, b = make(6, 577, 33, dtype, True)
    y = gemm.linear(x.view(2, 3, 577), weight, b)
    assert y.shape == (2, 3, 33)
    assert torch.equal(y.view(6, 33), gemm.linear(x, weight, b))


@needs_kernel
def test_results_do_not_depend_on_thread_count(c_only):
    x, weight, b = make(5, 577, 962, torch.float32, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, weight, b)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(gemm.linear(x, weight, b), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "case",
    [
        "zero rows",
        "more rows than the threshold",
        "fp16",
        "non-contiguous x",
        "transposed weight",
        "strided bias",
        "autograd",
    ],
)
def test_other_inputs_go_to_torch(case):
    k, n = 577, 33
    dtype = torch.float16 if case == "fp16" else torch.float32
    m = gemm.LINEAR_MAX_ROWS[torch.float32] + 1 if case == "more rows than the threshold" else 3
    x, weight, b = make(0 if case == "zero rows" else m, k, n, dtype, True)
    if case == "non-contiguous x":
        x = torch.randn(k, m).T
    if case == "transposed weight":
        weight = weight.T.contiguous().T
    if case == "strided bias":
        b = torch.randn(2 * n)[::2]
    if case == "autograd":
        weight.requires_grad_(True)
    assert not gemm._linear_native_ok(x, weight, b, gemm.LINEAR_MAX_ROWS.get(x.dtype, 0))
    y = gemm.linear(x, weight, b)
    assert torch.equal(y, F.linear(x, weight, b))
    if case == "autograd":
        y.sum().backward()
        assert weight.grad is not None


def test_mixed_dtypes_are_torch_s_error():
    x, weight, b = make(2, 20, 9, torch.bfloat16, True)
    assert not gemm._linear_native_ok(x, weight, b.float(), 1 << 62)
    with pytest.raises(RuntimeError):
        gemm.linear(x, weight, b.float())


def test_build_failure_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    def fail(source):
        raise build.BuildError("cc failed: error: simulated")

    monkeypatch.setattr(ops, "load_library", fail)
    gemm._library.cache_clear()
    gemm._linear_kernel.cache_clear()
    gemm._packing.cache_clear()
    try:
        x, weight, b = make(2, 577, 33, torch.float32, True)
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu.ops"):
            first = gemm.linear(x, weight, b)
            gemm.linear(x, weight, b)
        assert torch.equal(first, F.linear(x, weight, b))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "simulated" in warnings[0].getMessage()
    finally:
        gemm._library.cache_clear()
        gemm._linear_kernel.cache_clear()
        gemm._packing.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_portable_c_path_matches_float64(tmp_path, monkeypatch):
    """The plain C loop that machines without AVX2 compile (ops does not route to it)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    lib = build.load_library(gemm._SOURCE, extra_flags=("-U__AVX2__",))
    assert lib.pdserve_linear_simd() == 0
    kernel = gemm.linear_function(lib)
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in ((1, 20, 9), (3, 577, 33), (0, 5, 4)):
            x, weight, b = make(m, k, n, dtype, True)
            y = torch.full((m, n), float("nan"), dtype=dtype)
            args = (x.data_ptr(), weight.data_ptr(), b.data_ptr(), y.data_ptr(), m, n, k)
            assert kernel(*args, ops.NATIVE_DTYPES[dtype], 2) == 0
            assert_linear_close(y, expected(x, weight, b), k)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_every_backend_exposes_linear(name):
    if name == "triton":
        pytest.importorskip("triton")
    module = importlib.import_module(f"pdserve.kernels.{name}")
    params = inspect.signature(module.linear).parameters
    assert list(params) == list(inspect.signature(reference.linear).parameters)
    assert params["bias"].default is None
    x, weight, b = make(3, 20, 9, torch.float32, True)
    assert_linear_close(module.linear(x, weight, b), expected(x, weight, b), 20)


needs_packing = pytest.mark.skipif(
    shutil.which("cc") is None or gemm._packing() is None,
    reason="no AVX512-BF16 here: bf16 projections take the widening kernel",
)


@needs_packing
def test_packed_weight_follows_in_place_changes(c_only):
    """The packed copy is remade when the weight is written in place, and dropped with it."""
    x, weight, _ = make(5, 577, 70, torch.bfloat16, False)
    first = gemm.linear(x, weight)
    assert id(weight) in gemm._packed
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(gemm.linear(x, weight), (first.float() * 2).to(torch.bfloat16))
    key = id(weight)
    del weight
    assert key not in gemm._packed


@needs_packing
def test_widening_path_still_matches_float64():
    """The AVX2 kernel's bf16 path (machines without AVX512-BF16), called directly here."""
    kernel = gemm._linear_kernel()
    for m, k, n in ((1, 20, 9), (5, 577, 33), (17, 576, 962)):
        x, weight, b = make(m, k, n, torch.bfloat16, True)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        args = (x.data_ptr(), weight.data_ptr(), b.data_ptr(), y.data_ptr(), m, n, k)
        assert kernel(*args, ops.NATIVE_DTYPES[torch.bfloat16], 2) == 0
        assert_linear_close(y, expected(x, weight, b), k)


@needs_packing
@pytest.mark.parametrize("k", [3, 577])
def test_packed_odd_k_reads_nothing_past_x(k, c_only):
    """With odd K the last pair of x is (x[K-1], 0): the element after x (NaN here) stays unread."""
    x, weight, b = make(7, k, 65, torch.bfloat16, True)
    buf = torch.full((x.numel() + 1,), float("nan"), dtype=torch.bfloat16)
    buf[: x.numel()] = x.flatten()
    y = gemm.linear(buf[: x.numel()].view(7, k), weight, b)
    assert_linear_close(y, expected(x, weight, b), k)
