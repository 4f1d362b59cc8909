"""The CPU backend's own contract: building and caching the C kernel, fallbacks, input checks."""

from __future__ import annotations

import importlib
import inspect
import logging
import shutil

import pytest
import torch
from pdserve.kernels import reference
from pdserve.kernels.cpu import build, fused, ops

from pdserve import kernels
from tests.kernels.conftest import PREFILL_BATCH

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def parts_attention(dtype: torch.dtype) -> bool:
    """Whether decode attention over ``dtype`` pools goes by parts (decode_parts.h) in the library
    the test uses: bf16 on AVX512-BF16, fp32 on AVX-512 or AVX2."""
    return ops.attention_bf16_native() if dtype == torch.bfloat16 else ops.attention_f32_parts()


def decode_args(paged_case, dtype=torch.float32):
    case = paged_case([5, 40], 3, 64, 16, dtype)
    q = torch.randn(2, 9, 64).to(dtype)
    return case, (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory):
    """One cache directory for the module's variant libraries (the emulated, AVX2 and portable
    builds): each is compiled once (the cache key holds its flags), not once per test case."""
    return tmp_path_factory.mktemp("kernel-variants")


@pytest.fixture(params=["machine", "emulated", "avx2"])
def attention_build(request, variant_builds, monkeypatch):
    """The library a test of the parts path runs on: this machine's own (AVX512-BF16 where it has
    it); "emulated" (bf16 cases), where it lacks AVX512-BF16 but has AVX-512, one built with those
    two instructions written in AVX-512F (kernels/cpu/bf16_emulated.h, a stand-in for tests only),
    so that the bf16 paths' logic is checked on every AVX-512 machine; "avx2" (fp32 cases), on an
    AVX-512 machine, one built without AVX-512 (decode_256.h's tiles, as AVX2 machines run)."""
    dtype = request.node.callspec.params.get("dtype", torch.bfloat16)
    if request.param == "machine":
        return "machine"
    if request.param == "avx2":
        if dtype == torch.bfloat16:
            pytest.skip("bf16 pools take the portable path without AVX512-BF16")
        if not ops.attention_f32_512():
            pytest.skip("no AVX-512 here: the machine's library is the AVX2 (or portable) one")
        monkeypatch.setenv("PDSERVE_CACHE_DIR", str(variant_builds))
        flags = ("-mno-avx512f",)
        lib = ops.declare_attention(build.load_library(ops._SOURCE, extra_flags=flags))
        assert lib.pdserve_paged_attention_f32_parts() and not lib.pdserve_paged_attention_f32_512()
        monkeypatch.setattr(ops, "_library", lambda: lib)
        return "avx2"
    if dtype != torch.bfloat16:
        pytest.skip("fp32: the machine's library covers it")
    if ops.attention_bf16_native():
        pytest.skip("this machine runs the real AVX512-BF16 instructions (the 'machine' case)")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(variant_builds))
    flags = ("-DPDSERVE_EMULATE_AVX512BF16",)
    lib = ops.declare_attention(build.load_library(ops._SOURCE, extra_flags=flags))
    if not lib.pdserve_paged_attention_native():
        pytest.skip("no AVX-512 (BW, VL, DQ) here to stand in for AVX512-BF16")
    monkeypatch.setattr(ops, "_library", lambda: lib)
    return "emulated"


@pytest.fixture
def portable_attention(variant_builds, monkeypatch):
    """ops' attention library built without AVX (its portable paths: CPUs without AVX2, other
    architectures, head sizes other than 64 and 128), in place of the machine's own for the test."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(variant_builds))
    lib = ops.declare_attention(build.load_library(ops._SOURCE, extra_flags=("-mno-avx",)))
    assert not lib.pdserve_paged_attention_f32_parts()
    monkeypatch.setattr(ops, "_library", lambda: lib)
    return lib


@needs_compiler
def test_library_is_built_once_per_key_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    source = ops._SOURCE

    build.load_library(source)

    built = list(tmp_path.glob("kernels/*/paged_attention.so"))
    assert len(built) == 1
    assert not list(tmp_path.glob("kernels/*/.*"))  # no temporary file left behind
    mtime = built[0].stat().st_mtime_ns
    build.load_library(source)
    assert built[0].stat().st_mtime_ns == mtime


def test_missing_compiler_is_a_build_error(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.BuildError, match="no C compiler"):
        build.load_library(ops._SOURCE)


def test_build_failure_falls_back_to_reference_with_one_warning(paged_case, monkeypatch, caplog):
    def fail(source):
        raise build.BuildError("cc failed: error: simulated")

    monkeypatch.setattr(ops, "load_library", fail)
    ops._library.cache_clear()
    try:
        _, args = decode_args(paged_case)
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu.ops"):
            first = ops.paged_decode_attention(*args)
            ops.paged_decode_attention(*args)
        assert torch.equal(first, reference.paged_decode_attention(*args))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "simulated" in warnings[0].getMessage()
    finally:
        ops._library.cache_clear()


@needs_compiler
def test_out_of_range_block_id_raises(paged_case):
    case, args = decode_args(paged_case)
    case.block_tables[1, 1] = case.k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block ids outside"):
        ops.paged_decode_attention(*args)


@needs_compiler
def test_context_longer_than_block_table_raises(paged_case):
    case, args = decode_args(paged_case)
    case.context_lens[0] = case.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="beyond their block table"):
        ops.paged_decode_attention(*args)


def test_unsupported_dtype_uses_reference(paged_case):
    _, args = decode_args(paged_case, torch.float16)
    out = ops.paged_decode_attention(*args)
    assert out.dtype == torch.float16
    assert torch.equal(out, reference.paged_decode_attention(*args))


def test_get_backend_by_device(monkeypatch):
    monkeypatch.delenv("PDSERVE_KERNEL_BACKEND", raising=False)
    assert kernels.get_backend("cpu") is kernels.cpu
    assert kernels.get_backend(torch.device("meta")) is reference


def test_get_backend_forced(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "reference")
    assert kernels.get_backend("cpu") is reference
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "fast")
    with pytest.raises(ValueError, match="not a kernel backend"):
        kernels.get_backend("cpu")


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_backends_share_the_reference_signatures(name):
    if name == "triton":
        pytest.importorskip("triton")
    module = importlib.import_module(f"pdserve.kernels.{name}")
    for fn in (
        "write_kv",
        "paged_decode_attention",
        "prefill_attention",
        "gather_blocks",
        "scatter_blocks",
        "linear",
        "rms_norm",
        "rope_write_kv",
        "silu_mul",
        "empty_pool",
        "gather_kv_blocks",
        "kv_block_writer",
    ):
        expected = list(inspect.signature(getattr(reference, fn)).parameters)
        assert list(inspect.signature(getattr(module, fn)).parameters) == expected, fn


@needs_compiler
@pytest.mark.parametrize(
    "heads",
    [(9, 3, 64), (2, 2, 64), (12, 3, 64), (16, 2, 128), (4, 4, 128)],
    ids=lambda h: "q{}-kv{}-d{}".format(*h),
)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_attention_by_parts(
    attention_build, heads, block_size, dtype, paged_case, dense, close
):
    """The parts path on AVX-512 or AVX2 tiles (decode_512.h, decode_256.h; bf16 pools on
    AVX512-BF16 only): 16-token tiles that span blocks (block_size < 16) or split them, query-head
    groups that fill 1 to 4 chunks of registers, head_dim 64 and 128. Pool rows past every sequence hold NaN: the lanes of a
    tile's last, partial part must not read them."""
    if not ops.native_available() or not parts_attention(dtype):
        pytest.skip(f"{dtype} decode attention takes the portable path in this build")
    num_heads, num_kv_heads, head_dim = heads
    lens = [1, 15, 16, 17, 40, 100]
    case = paged_case(lens, num_kv_heads, head_dim, block_size, dtype, seed=block_size)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale)
    out = ops.paged_decode_attention(*args)
    close(out, dense(q, case.seq_k, case.seq_v, [1] * len(lens), scale), dtype)


@needs_compiler
@pytest.mark.parametrize(
    "heads",
    [(9, 3, 64), (12, 3, 64), (16, 2, 128), (4, 4, 128)],
    ids=lambda h: "q{}-kv{}-d{}".format(*h),
)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_native_bf16_prefill_attention(
    attention_build, heads, block_size, paged_case, dense, close
):
    """The AVX512-BF16 prefill: blocks of 16 queries in quads of 4 (partial ones too), tiles
    crossing the causal diagonal, more keys than one 512-key softmax chunk (the rescale between
    chunks), cached prefixes of any length, a query strided as the fused qkv projection leaves it."""
    if not ops.native_available() or not ops.attention_bf16_native():
        pytest.skip("no AVX512-BF16 here: bf16 prefill attention takes SDPA")
    num_heads, num_kv_heads, head_dim = heads
    seqs = PREFILL_BATCH
    q_lens = [n for n, _ in seqs]
    case = paged_case(
        [n + p for n, p in seqs],
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        seed=block_size,
    )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(sum(q_lens), width).to(torch.bfloat16)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)  # token stride = width
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    args = (
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        query_start_loc,
        case.context_lens,
        scale,
    )
    out = ops.prefill_attention(*args)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    close(out, dense(q, case.seq_k, case.seq_v, q_lens, scale), torch.bfloat16)


@needs_compiler
def test_native_prefill_rejects_bad_context(attention_build, paged_case):
    if not ops.native_available() or not ops.attention_bf16_native():
        pytest.skip("no AVX512-BF16 here")
    case = paged_case([20], 3, 64, 16, torch.bfloat16)
    q = torch.randn(20, 9, 64).to(torch.bfloat16)
    starts = torch.tensor([0, 20], dtype=torch.int32)
    case.context_lens[0] = 10  # fewer positions than new tokens
    with pytest.raises(ValueError, match="context_len below their new tokens"):
        ops.prefill_attention(
            q, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125
        )


@needs_compiler
def test_portable_bf16_paths_without_avx512_bf16(tmp_path, monkeypatch, paged_case, dense, close):
    """Where the CPU lacks AVX512-BF16 the same C files take their portable bf16 paths (rows
    widened to fp32): built here with the extension switched off, they must still be right."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    flags = ("-mno-avx512bf16",)
    attention = ops.declare_attention(build.load_library(ops._SOURCE, extra_flags=flags))
    fused_lib = fused.declare_fused(build.load_library(fused._SOURCE, extra_flags=flags))
    assert not attention.pdserve_paged_attention_native()
    monkeypatch.setattr(ops, "_library", lambda: attention)
    monkeypatch.setattr(fused, "_fused_library", lambda: fused_lib)
    bf16 = torch.bfloat16

    case = paged_case([1, 17, 100], 3, 64, 16, bf16)
    q = torch.randn(3, 9, 64).to(bf16)
    out = ops.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    close(out, dense(q, case.seq_k, case.seq_v, [1] * 3, 0.125), bf16)

    x, residual = torch.randn(5, 576).to(bf16), torch.randn(5, 576).to(bf16)
    weight = torch.rand(576).to(bf16)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual.clone())
    got, got_residual = fused.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    gate_up = torch.randn(5, 2 * 1536).mul(4).to(bf16)
    torch.testing.assert_close(
        fused.silu_mul(gate_up).float(), reference.silu_mul(gate_up).float(), atol=1e-30, rtol=2**-8
    )
    qkv = torch.randn(4, 15 * 64).to(bf16)
    cos, sin = torch.randn(64, 64), torch.randn(64, 64)
    positions, slots = torch.tensor([3, 9, 27, 63]), torch.tensor([0, 5, 6, 31])
    caches = [torch.zeros(2, 16, 3, 64, dtype=bf16) for _ in range(4)]
    want_q = reference.rope_write_kv(
        qkv.clone(), positions, cos, sin, 9, caches[0], caches[1], slots
    )
    assert torch.equal(
        fused.rope_write_kv(qkv, positions, cos, sin, 9, caches[2], caches[3], slots), want_q
    )
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@needs_compiler
def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """The cache key covers the headers a kernel includes, not only its .c file."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.h").write_text("static int value(void) { return 1; }\n")
    (src / "k.c").write_text('#include "k.h"\nint pdserve_value(void) { return value(); }\n')
    assert build.load_library(src / "k.c").pdserve_value() == 1
    (src / "k.h").write_text("static int value(void) { return 2; }\n")
    assert build.load_library(src / "k.c").pdserve_value() == 2
    assert len(list((tmp_path / "cache").glob("kernels/*/k.so"))) == 2


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_long_contexts_split_in_spans_merge_exactly(
    dtype, block_size, portable_attention, paged_case, dense, close
):
    """The portable path (built here without AVX, as a CPU without AVX2 runs it) splits a
    context into spans of 256 tokens run in parallel and merges them: right on both sides of a
    span's edge and over many spans; a sequence's result does not depend on the batch it runs in
    nor on the thread count (spans are fixed, not sized to fit)."""
    lens = [255, 256, 257, 600, 1030]
    case = paged_case(lens, 3, 64, block_size, dtype)
    q = torch.randn(len(lens), 9, 64).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = ops.paged_decode_attention(*args)
        torch.set_num_threads(1)
        alone = [
            ops.paged_decode_attention(
                q[i : i + 1],
                *args[1:3],
                case.block_tables[i : i + 1],
                case.context_lens[i : i + 1],
                0.125,
            )
            for i in range(len(lens))
        ]
    finally:
        torch.set_num_threads(threads)
    close(batched, dense(q, case.seq_k, case.seq_v, [1] * len(lens), 0.125), dtype)
    assert torch.equal(batched, torch.cat(alone))


@needs_compiler
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (16, 2, 128)], ids=lambda h: "q{}-kv{}-d{}".format(*h)
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_parts_merge_the_same_for_any_batch_and_threads(
    attention_build, heads, block_size, dtype, paged_case, dense, close
):
    """The parts path splits a context into parts of 128 tokens (computed by one thread a
    sequence, or by every thread at batch 1) merged in order: right on both sides of a part's
    edge and over many parts; a sequence's result is the same alone on 1 or 2 threads and in a
    batch (the parts are fixed, not sized to the threads)."""
    if not ops.native_available() or not parts_attention(dtype):
        pytest.skip(f"{dtype} decode attention takes the portable path in this build")
    num_heads, num_kv_heads, head_dim = heads
    lens = [127, 128, 129, 600, 1030]
    case = paged_case(lens, num_kv_heads, head_dim, block_size, dtype, seed=3)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    threads = torch.get_num_threads()

    def alone(i: int) -> torch.Tensor:
        rows = slice(i, i + 1)
        return ops.paged_decode_attention(
            q[rows], *args[1:3], case.block_tables[rows], case.context_lens[rows], 0.125
        )

    try:
        torch.set_num_threads(2)
        batched = ops.paged_decode_attention(*args)  # a sequence per thread at a time
        split = [alone(i) for i in range(len(lens))]  # its parts on both threads
        rows = slice(2, 5)  # three sequences: all their parts dealt to both threads
        few = ops.paged_decode_attention(
            q[rows], *args[1:3], case.block_tables[rows], case.context_lens[rows], 0.125
        )
        torch.set_num_threads(1)
        single = [alone(i) for i in range(len(lens))]
    finally:
        torch.set_num_threads(threads)
    close(batched, dense(q, case.seq_k, case.seq_v, [1] * len(lens), 0.125), dtype)
    assert torch.equal(batched, torch.cat(split))
    assert torch.equal(batched, torch.cat(single))
    assert torch.equal(batched[2:5], few)


@needs_compiler
def test_bad_block_in_a_later_span_counts_once_per_kv_head(paged_case):
    case = paged_case([600, 40], 3, 64, 16, torch.float32)
    q = torch.randn(2, 9, 64)
    case.block_tables[0, 30] = -1  # in the second span of sequence 0
    with pytest.raises(ValueError, match="^paged_decode_attention: 3 \\(sequence, kv head\\)"):
        ops.paged_decode_attention(
            q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
        )
