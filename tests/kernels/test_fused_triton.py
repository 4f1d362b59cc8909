"""The Triton fused ops (kernels/triton/fused.py) against the reference in torch: under the
Triton interpreter on CPU tensors everywhere, and on CUDA tensors where a GPU is (``gpu``).

rope_write_kv must equal the reference bit for bit (it rounds where torch rounds; on a GPU fp32
may take an FMA, so there it is held to fp32's last places); rms_norm and silu_mul may differ in
the last place of a few elements (another summation order, Triton's exp), as the C kernels do.
"""

from __future__ import annotations

import pytest
import torch
from pdserve.kernels import reference

from tests.gpu import GPU
from tests.kernels.test_fused import assert_within_ulps, rope_case
from tests.kernels.test_kernels_backends import load_backend

DEVICES = [
    pytest.param("cpu", id="triton-interpreter"),
    pytest.param("cuda", id="triton-cuda", marks=GPU),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def fused(device: str):
    return load_backend("triton", device).fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 576), (7, 576), (3, 100)])
def test_rms_norm_with_and_without_residual(device, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(rows, n, generator=gen).to(dtype).to(device)
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(device)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual.clone())
    want_plain, _ = reference.rms_norm(x, weight, 1e-5)
    got_plain, passed_on = fused(device).rms_norm(x, weight, 1e-5)
    assert passed_on is x
    assert_within_ulps(got_plain.cpu(), want_plain.cpu(), 0.02, ulps=2)
    got, got_residual = fused(device).rms_norm(x, weight, 1e-5, residual)
    assert got_residual is residual  # updated in place
    assert torch.equal(got_residual, want_residual)  # one rounded add: exact
    assert_within_ulps(got.cpu(), want.cpu(), 0.02, ulps=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (4, 4, 32), (6, 2, 20)], ids=lambda h: "q{}-kv{}-d{}".format(*h)
)
def test_rope_write_kv_matches_reference(device, dtype, heads):
    args, slots, caches, want_q = rope_case(dtype, heads, device)
    qkv = args[0]
    got_q = fused(device).rope_write_kv(*args, *caches[2:], slots)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    pairs = [(got_q, want_q), (caches[2], caches[0]), (caches[3], caches[1])]
    for got, want in pairs:  # the written slots, and only them (NaN elsewhere)
        got, want = got.cpu().nan_to_num(7.0), want.cpu().nan_to_num(7.0)
        if device == "cuda" and dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-7)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_write_kv_leaves_out_of_range_tokens(device):
    """A token with a position or slot outside the table or the pools writes nothing."""
    qkv = torch.randn(3, 5 * 8, device=device)
    cos = sin = torch.ones(10, 8, device=device)
    caches = [torch.zeros(2, 4, 1, 8, device=device) for _ in range(2)]
    positions = torch.tensor([0, 10, 2], device=device)
    slots = torch.tensor([0, 1, 8], device=device)
    before = qkv.clone()
    fused(device).rope_write_kv(qkv, positions, cos, sin, 3, *caches, slots)
    assert torch.equal(qkv[1:], before[1:])
    written = caches[0].view(8, 8).abs().sum(-1).cpu() > 0
    assert written.tolist() == [True] + [False] * 7


# exp(100) overflows to inf in the interpreter's numpy (silu(-100) = -100 / inf = -0, as torch)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device, dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, 0.0, 1e-30, 88.0, 100.0]).to(dtype)  # exp's ends
    gate_up = gate_up.to(device)
    want = reference.silu_mul(gate_up)
    assert_within_ulps(fused(device).silu_mul(gate_up).cpu(), want.cpu(), 0.02)
