"""bf16 KV pools under an fp32 model (``--kv-cache-dtype bfloat16``): the C kernels read the pools
at 2 bytes a value and widen them in registers. A bf16 value widened is an exact fp32 value, so
where a kernel then computes as over fp32 pools (the portable decode path, prefill) its result
must be bit for bit the one it gives over fp32 pools holding those values; decode attention's
AVX-512 and AVX2 tiles split a register of bf16 values into its even and odd dimensions (no
shuffle) and sum a dot product in that order, so theirs must be within fp32 rounding of it (and
of a float64 reference). RoPE's KV write must round as torch's ``.to(torch.bfloat16)`` does."""

from __future__ import annotations

import shutil

import pytest
import torch
from pdserve.kernels import reference
from pdserve.kernels.cpu import build, fused, ops

from tests.kernels.test_fused import no_reference, rope_case

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
HEADS = [(9, 3, 64), (16, 2, 128), (4, 4, 128), (6, 2, 32)]  # d 32: the portable path everywhere


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Libraries built once for this module, by flags."""
    libs = {}

    def get(flags: tuple[str, ...]):
        if flags not in libs:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
                libs[flags] = ops.declare_attention(
                    build.load_library(ops._SOURCE, extra_flags=flags)
                )
        return libs[flags]

    return get


@pytest.fixture(params=["machine", "avx2", "portable"])
def attention_lib(request, built, monkeypatch):
    """The attention library under test: this machine's own (AVX-512 or AVX2 tiles), on AVX-512
    machines one built without AVX-512 (the AVX2 machines' tiles), and one built without AVX (the
    portable path)."""
    if request.param == "machine":
        lib = ops._library()
        if lib is None:
            pytest.skip("no C compiler")
        return lib
    if request.param == "avx2" and not ops.attention_f32_512():
        pytest.skip("no AVX-512 here: the machine's library is the AVX2 (or portable) one")
    lib = built(("-mno-avx512f",) if request.param == "avx2" else ("-mno-avx",))
    assert bool(lib.pdserve_paged_attention_f32_parts()) == (request.param == "avx2")
    monkeypatch.setattr(ops, "_library", lambda: lib)
    return lib


@needs_compiler
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "q{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("lens", [[1, 15, 17, 100, 600], [1030]], ids=["batch", "one"])
def test_decode_attention_over_bf16_pools_equals_the_widened_pools(
    attention_lib, heads, block_size, lens, paged_case, dense, close, monkeypatch
):
    num_heads, num_kv_heads, head_dim = heads
    case = paged_case(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=block_size)
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    rest = (case.block_tables, case.context_lens, head_dim**-0.5)
    monkeypatch.setattr(
        ops.reference, "paged_decode_attention", lambda *a: pytest.fail("fell back")
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # batch 1 splits its context over both threads
        got = ops.paged_decode_attention(q, case.k_cache, case.v_cache, *rest)
        want = ops.paged_decode_attention(q, case.k_cache.float(), case.v_cache.float(), *rest)
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.float32
    if attention_lib.pdserve_paged_attention_f32_parts() and head_dim in (64, 128):
        # the tiles' order of summation (split dimensions): fp32 rounding apart, no more
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    else:
        assert torch.equal(got, want)
    close(got, dense(q, case.seq_k, case.seq_v, [1] * len(lens), head_dim**-0.5), torch.float32)


@needs_compiler
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (4, 4, 32), (2, 1, 128)], ids=lambda h: "q{}-kv{}-d{}".format(*h)
)
def test_rope_writes_fp32_rows_into_bf16_pools_as_torch_rounds(heads, monkeypatch):
    (qkv, positions, cos, sin, num_heads), slots, caches, want_q = rope_case(torch.float32, heads)
    pools = [torch.full_like(caches[0], float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    args = (positions, cos, sin, num_heads)
    assert torch.equal(reference.rope_write_kv(qkv.clone(), *args, *pools[:2], slots), want_q)
    no_reference(monkeypatch)
    got_q = fused.rope_write_kv(qkv.clone(), *args, *pools[2:], slots)
    assert got_q.dtype == torch.float32 and torch.equal(got_q, want_q)
    for got, want in zip(pools[2:], pools[:2], strict=True):  # written slots, and only them
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_kv_codes():
    """Which (activations, pools) pairs the C kernels take: one dtype, or fp32 over bf16."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert [ops.kv_code(f32, f32), ops.kv_code(bf16, bf16), ops.kv_code(f32, bf16)] == [0, 1, 2]
    assert ops.kv_code(bf16, f32) is None and ops.kv_code(f16, f16) is None
