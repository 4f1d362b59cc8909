"""The CPU backend's fused per-token ops (``fused.c``) against the reference in torch.

rope_write_kv rounds exactly where torch's bf16 operators round, so its outputs must be equal bit
for bit. rms_norm sums the squares in another order (and in double), and silu_mul has its own exp:
those may differ in the last place in a small share of elements: by one bf16 ulp for silu_mul,
by up to two for rms_norm (a one-ulp change of the normalized value, times a weight above 1, then
rounded again).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pdserve.kernels import reference
from pdserve.kernels.cpu import fused

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or fused._fused_library() is None,
    reason="the fused C kernels did not build here; the CPU backend uses the reference",
)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def no_reference(monkeypatch):
    """Fail if ops falls back to the reference: proves the C kernel produced the result."""
    for name in ("rms_norm", "rope_write_kv", "silu_mul", "argmax"):
        monkeypatch.setattr(
            fused.reference, name, lambda *a, name=name, **k: pytest.fail(f"{name} fell back")
        )


def assert_within_ulps(
    actual: torch.Tensor, expected: torch.Tensor, share: float, ulps: int = 1
) -> None:
    """Equal, except at most ``share`` of the elements up to ``ulps`` units in the last place apart."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16:
        assert torch.equal(actual.sign(), expected.sign())
        a, e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
        diff = (a - e).abs()
        assert int(diff.max()) <= ulps
        assert (diff > 0).float().mean().item() <= share
    else:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=4e-7 * 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_rms_norm_with_and_without_residual(dtype, rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual.clone())
    want_plain, _ = reference.rms_norm(x, weight, 1e-5)
    no_reference(monkeypatch)
    got_plain, passed_on = fused.rms_norm(x, weight, 1e-5)
    assert passed_on is x
    assert_within_ulps(got_plain, want_plain, 0.01, ulps=2)
    got, got_residual = fused.rms_norm(x, weight, 1e-5, residual)
    assert got_residual is residual  # updated in place
    assert torch.equal(got_residual, want_residual)  # one rounded add: exact
    assert_within_ulps(got, want, 0.01, ulps=2)


def rope_case(dtype: torch.dtype, heads: tuple[int, int, int], device: str = "cpu"):
    """A rope_write_kv call's operands (37 tokens at random positions and slots, random
    frequencies) with four NaN-filled pools, and the reference's rotated q, which wrote the
    first two pools; a backend writes the other two."""
    num_heads, num_kv_heads, head_dim = heads
    tokens, num_blocks, block_size = 37, 8, 16
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * torch.rand(
        head_dim // 2, generator=gen
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    qkv, positions, slots = qkv.to(device), positions.to(device), slots.to(device)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]
    want_q = reference.rope_write_kv(
        qkv.clone(), positions, cos, sin, num_heads, caches[0], caches[1], slots
    )
    return (qkv, positions, cos, sin, num_heads), slots, caches, want_q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (4, 4, 32), (2, 1, 128)], ids=lambda h: "q{}-kv{}-d{}".format(*h)
)
def test_rope_write_kv_matches_reference_bit_for_bit(dtype, heads, monkeypatch):
    args, slots, caches, want_q = rope_case(dtype, heads)
    no_reference(monkeypatch)
    got_q = fused.rope_write_kv(*args, caches[2], caches[3], slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(
        caches[2].nan_to_num(7.0), caches[0].nan_to_num(7.0)
    )  # written slots, and only them
    assert torch.equal(caches[3].nan_to_num(7.0), caches[1].nan_to_num(7.0))


@pytest.mark.parametrize("bad", ["slot", "position"])
def test_rope_write_kv_refuses_out_of_range_tokens(bad):
    qkv = torch.randn(3, 5 * 8)
    cos = sin = torch.ones(10, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    positions, slots = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
    if bad == "slot":
        slots[1] = 8  # 2 blocks x 4 slots
    else:
        positions[2] = 10
    with pytest.raises(
        ValueError,
        match="1 tokens have a position outside \\[0, 10\\) or a slot outside \\[0, 8\\)",
    ):
        fused.rope_write_kv(qkv, positions, cos, sin, 3, k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(33, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, 0.0, 1e-30, 88.0, 100.0]).to(dtype)  # exp's ends
    want = reference.silu_mul(gate_up)
    no_reference(monkeypatch)
    assert_within_ulps(fused.silu_mul(gate_up), want, 0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_eight_lanes_at_a_time_equal_one_at_a_time(dtype, monkeypatch):
    """Rows go through silu_mul eight elements at a time and their tail one at a time (bf16: where
    there is no AVX-512): the same values give the same bits either way, the ends of exp's range,
    infinities and NaN included."""
    no_reference(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    gate = torch.randn(45, generator=gen) * 30
    gate[:9] = torch.tensor([-100.0, -88.0, -87.3, 0.0, 1e-30, 88.0, 88.8, 100.0, -0.0])
    gate[9:12] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    up = torch.randn(45, generator=gen)
    gate, up = gate.to(dtype), up.to(dtype)
    lanes = fused.silu_mul(torch.cat([gate, up])[None])  # 5 vectors of 8, then a tail of 5
    ones = torch.cat(
        [fused.silu_mul(torch.stack([g, u])[None]) for g, u in zip(gate, up, strict=True)], 1
    )
    torch.testing.assert_close(lanes, ones, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 15, 16, 17, 49152])
def test_argmax_matches_torch_ties_and_nans(vocab, monkeypatch):
    """Random rows (bf16-rounded logits repeat values: ties), then the cases torch defines: the
    first of equal maxima, the first NaN, rows of -inf, a maximum in the tail past the last 16."""
    no_reference(monkeypatch)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=gen).bfloat16().float()
    logits[1] = 0.5  # every element ties
    logits[2] = float("-inf")
    if vocab > 3:
        logits[3, vocab // 2] = 9.0
        logits[3, vocab - 1] = 9.0  # a tie: the first one
        logits[4, 2] = float("nan")
        logits[4, vocab - 1] = float("nan")  # two NaNs: the first
        logits[5, vocab - 1] = 100.0  # the tail
        logits[6, 0] = -0.0
        logits[6, 1:] = -1.0
        logits[6, vocab // 2] = 0.0  # -0 and +0 are equal: the first
    expected = logits.argmax(dim=-1)
    assert torch.equal(fused.argmax(logits), expected)
    assert fused.argmax(logits).dtype == torch.int64


def test_unsupported_inputs_take_the_reference():
    x = torch.randn(4, 16, dtype=torch.float16)
    weight = torch.ones(16, dtype=torch.float16)
    out, _ = fused.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, reference.rms_norm(x, weight, 1e-6)[0])
    gate_up = torch.randn(8, 4)[:, ::2]  # not contiguous
    assert torch.equal(fused.silu_mul(gate_up), reference.silu_mul(gate_up))
