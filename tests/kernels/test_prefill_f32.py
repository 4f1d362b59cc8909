"""fp32 prefill attention in C (kernels/cpu/prefill_f32.h): an fp32 model's prompts, over fp32 or
bf16 pools, in every build of paged_attention.c (this machine's, AVX2, portable)."""

from __future__ import annotations

import shutil

import pytest
import torch
from pdserve.kernels.cpu import build, ops

from tests.kernels.conftest import PREFILL_BATCH

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory):
    return tmp_path_factory.mktemp("prefill-f32-builds")


@pytest.fixture(params=["machine", "avx2", "portable"])
def prefill_build(request, variant_builds, monkeypatch):
    """The attention library the test runs on: the machine's, one built without AVX-512 (what
    AVX2 machines run; skipped where that is the machine's own) and one without AVX."""
    if request.param == "machine":
        if ops._library() is None:
            pytest.skip("the C attention library did not build here")
        return ops._library()
    if request.param == "avx2" and not ops.attention_f32_512():
        pytest.skip("no AVX-512 here: the machine's library is the AVX2 (or portable) one")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(variant_builds))
    flags = ("-mno-avx512f",) if request.param == "avx2" else ("-mno-avx",)
    lib = ops.declare_attention(build.load_library(ops._SOURCE, extra_flags=flags))
    monkeypatch.setattr(ops, "_library", lambda: lib)
    return lib


def _inputs(paged_case, seqs, heads, block_size, pool_dtype, seed=0):
    num_heads, num_kv_heads, head_dim = heads
    q_lens = [n for n, _ in seqs]
    case = paged_case(
        [n + p for n, p in seqs], num_kv_heads, head_dim, block_size, pool_dtype, seed=seed
    )
    # q strided as the fused qkv projection leaves it (token stride = the qkv row)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(sum(q_lens), width, generator=torch.Generator().manual_seed(seed))
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return case, q, q_lens, starts


@needs_compiler
@pytest.mark.parametrize(
    "heads",
    [(9, 3, 64), (12, 3, 64), (16, 2, 128), (4, 4, 128), (6, 2, 80)],
    ids=lambda h: "q{}-kv{}-d{}".format(*h),
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_prefill_attention_against_dense(
    prefill_build, heads, block_size, pool_dtype, paged_case, dense, close, monkeypatch
):
    """Every shape of batch above, against float64 attention on the sequences' own K/V; the
    torch fallback is switched off, so the C kernel is what ran."""
    case, q, q_lens, starts = _inputs(paged_case, PREFILL_BATCH, heads, block_size, pool_dtype)
    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", None)
    scale = heads[2] ** -0.5
    out = ops.prefill_attention(
        q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, scale
    )
    assert out.shape == q.shape and out.dtype == torch.float32
    close(out, dense(q, case.seq_k, case.seq_v, q_lens, scale), torch.float32)


@needs_compiler
def test_a_sequence_is_computed_alike_in_any_batch_and_thread_count(prefill_build, paged_case):
    """A prompt's outputs do not depend on what else its step prefills, nor on the threads: bit
    for bit (the same prompt alone, in a batch, on 1 and 2 threads)."""
    seqs = [(33, 67), (530, 0), (5, 16)]
    case, q, q_lens, starts = _inputs(paged_case, seqs, (9, 3, 64), 16, torch.bfloat16)
    rest = (case.k_cache, case.v_cache)
    batch = ops.prefill_attention(q, *rest, case.block_tables, starts, case.context_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for s in range(len(seqs)):
                lo, hi = int(starts[s]), int(starts[s + 1])
                alone = ops.prefill_attention(
                    q[lo:hi],
                    *rest,
                    case.block_tables[s : s + 1],
                    torch.tensor([0, hi - lo], dtype=torch.int32),
                    case.context_lens[s : s + 1],
                    0.125,
                )
                assert torch.equal(alone, batch[lo:hi]), (n, s)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_pools_give_what_their_widened_values_give(prefill_build, paged_case, pool_dtype):
    """bf16 pools are widened exactly: the same outputs, bit for bit, as the same values in fp32
    pools."""
    case, q, _, starts = _inputs(paged_case, [(40, 0), (7, 293)], (9, 3, 64), 16, torch.bfloat16)
    rest = (case.block_tables, starts, case.context_lens, 0.125)
    got = ops.prefill_attention(q, case.k_cache, case.v_cache, *rest)
    want = ops.prefill_attention(q, case.k_cache.float(), case.v_cache.float(), *rest)
    assert torch.equal(got, want)


@needs_compiler
def test_bad_context_or_block_is_a_clear_error(prefill_build, paged_case):
    case, q, _, starts = _inputs(paged_case, [(20, 0)], (9, 3, 64), 16, torch.float32)
    args = (q, case.k_cache, case.v_cache)
    short = case.context_lens.clone()
    short[0] = 10  # fewer positions than new tokens
    with pytest.raises(ValueError, match="context_len below their new tokens"):
        ops.prefill_attention(*args, case.block_tables, starts, short, 0.125)
    bad = case.block_tables.clone()
    bad[0, 1] = case.k_cache.shape[0]  # past the pool
    with pytest.raises(ValueError, match=r"block ids outside \[0, "):
        ops.prefill_attention(*args, bad, starts, case.context_lens, 0.125)


def test_head_sizes_it_does_not_take_go_to_torch(paged_case, dense, close):
    """head_dim 40 (not a multiple of 16): torch's SDPA, still right."""
    case, q, q_lens, starts = _inputs(paged_case, [(9, 0), (4, 20)], (4, 2, 40), 16, torch.float32)
    out = ops.prefill_attention(
        q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.1
    )
    close(out, dense(q, case.seq_k, case.seq_v, q_lens, 0.1), torch.float32)
