"""Kernel micro-benchmarks on CPU (print only): python -m bench.kernels [--threads N] [--only S].

attention: decode attention for 32 sequences x 600 tokens, 9 heads / 3 kv heads / head_dim 64
(the default model's layer), blocks of 16 in shuffled order: reference vs the C kernel vs a
"gather then bmm" baseline, ms per layer and GB/s of K/V read (one layer's K/V, which stays in
the L3); then the C kernel over 30 layers' pools, each read once per pass (from memory, as in a
decode step; bf16 and fp32 at 32 sequences, fp32 at batch 1). Then prefill attention and the KV
write/transfer ops (sections prefill, copies).

linear: every projection of the default model (30 layers of qkv, o, gate_up, down, and the
lm_head), each layer's weights distinct so caches do not flatter, for a few rows of x: the C
kernel (gemm.linear) vs torch's F.linear, ms per step and GB/s of weights read.

quant: the same projections quantized (Q4_1, Q4_0, Q8_0; each layer its own weights, 84-143 MB,
so they stream from memory), a few rows of fp32 x, quant.c's AVX-512 and AVX2 builds, ms per step
and GB/s of packed weights read (up to quant.integer_rows() rows: the integer path too, on the same
weights, where the build has it); with --quant-baseline OTHER.c (e.g. `git show
main:kernels/cpu/quant.c > /tmp/quant_main.c`) that source too, alternating call by call in one
run, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from pdserve.kernels import quantized, reference
from pdserve.kernels.cpu import gemm, ops, quant

BLOCK_SIZE = 16


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def make_pool(
    num_seqs: int, context_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    ids = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq]
    return k_cache, v_cache, ids.view(num_seqs, blocks_per_seq).to(torch.int32)


def gather_dense(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every sequence's blocks copied out: ``[num_seqs * num_kv_heads, max_len, head_dim]``."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    x = cache.index_select(0, block_tables.long().flatten())
    x = x.view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    return x.reshape(num_seqs * num_kv_heads, max_blocks * block_size, head_dim)


def bmm_decode(q, k, v, context_lens, scale):
    """Grouped bmm over dense K/V (rows = a kv head's query heads) in q.dtype, softmax in fp32."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0] // num_seqs
    max_len = k.shape[1]
    qg = q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale
    pad = torch.arange(max_len)[None, :] >= context_lens[:, None]  # [num_seqs, max_len]
    scores = scores.view(num_seqs, num_kv_heads, -1, max_len)
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_seqs * num_kv_heads, -1, max_len)
    return torch.bmm(probs, v).view(num_seqs, num_heads, head_dim)


def gather_bmm_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Baseline: copy every context into a padded dense tensor each step, then grouped bmm."""
    k, v = gather_dense(k_cache, block_tables), gather_dense(v_cache, block_tables)
    return bmm_decode(q, k, v, context_lens, scale)


def bench_decode(dtype: torch.dtype, repeats: int) -> None:
    num_seqs, context_len, num_heads, num_kv_heads, head_dim = 32, 600, 9, 3, 64
    k_cache, v_cache, block_tables = make_pool(num_seqs, context_len, num_kv_heads, head_dim, dtype)
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * k_cache.element_size()
    expected = reference.paged_decode_attention(*args).float()
    k, v = gather_dense(k_cache, block_tables), gather_dense(v_cache, block_tables)

    def bmm_only(q, k_cache, v_cache, block_tables, context_lens, scale):
        return bmm_decode(q, k, v, context_lens, scale)

    for name, fn, reps in (
        ("reference", reference.paged_decode_attention, max(3, repeats // 10)),
        ("gather+bmm", gather_bmm_decode, repeats),
        ("bmm, no gather", bmm_only, repeats),  # a lower bound: K/V already dense
        ("cpu C kernel", ops.paged_decode_attention, repeats),
    ):
        err = (fn(*args).float() - expected).abs().max().item()
        ms = median_ms(lambda fn=fn: fn(*args), reps)
        print(
            f"  decode {str(dtype)[6:]:8s} {name:14s} {ms:8.3f} ms/layer "
            f"{kv_bytes / ms / 1e6:7.1f} GB/s of KV   max|err| {err:.1e}"
        )


def bench_decode_cold(
    dtype: torch.dtype,
    repeats: int,
    num_seqs: int = 32,
    layers: int = 30,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """The C decode kernel as a decode step meets it: 30 layers' pools (~440 MB in bf16 at 32
    sequences), each layer's K/V read once per pass, so it comes from memory, not from the L3.
    ``kv_dtype``: the pools' (bf16 under an fp32 query: ``--kv-cache-dtype``); None: ``dtype``."""
    context_len, num_heads, num_kv_heads, head_dim = 576, 9, 3, 64
    kv_dtype = kv_dtype or dtype
    pools = [
        make_pool(num_seqs, context_len, num_kv_heads, head_dim, kv_dtype) for _ in range(layers)
    ]
    block_tables = pools[0][2]  # one table for every layer, as in the engine
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * kv_dtype.itemsize

    def step() -> None:
        for k_cache, v_cache, _ in pools:
            ops.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5
            )

    ms = median_ms(step, max(3, repeats // 10)) / layers
    kinds = str(dtype)[6:] if kv_dtype == dtype else f"{str(dtype)[6:]}/{str(kv_dtype)[6:]}"
    print(
        f"  decode {kinds:8s} {'C, from memory':14s} {ms:8.3f} ms/layer "
        f"{kv_bytes / ms / 1e6:7.1f} GB/s of KV   ({layers} layers' pools, {num_seqs} x "
        f"{context_len} tokens)"
    )


def bench_prefill(dtype: torch.dtype, repeats: int) -> None:
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    cases = {  # name: (new tokens per sequence, cached prefix per sequence)
        "4 x 256 new": ([256] * 4, [0] * 4),
        "1 x 512 new": ([512], [0]),
        "2 x 128 new after 384": ([128] * 2, [384] * 2),
    }
    for name, (q_lens, prefixes) in cases.items():
        context = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        k_cache, v_cache, block_tables = make_pool(
            len(q_lens), max(context), num_kv_heads, head_dim, dtype
        )
        q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
        starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        args = (
            q,
            k_cache,
            v_cache,
            block_tables,
            starts,
            torch.tensor(context, dtype=torch.int32),
            head_dim**-0.5,
        )
        expected = reference.prefill_attention(*args).float()
        for impl, fn in (
            ("reference", reference.prefill_attention),
            ("cpu", ops.prefill_attention),  # C (bf16: with AVX512-BF16, else SDPA; fp32: C)
        ):
            err = (fn(*args).float() - expected).abs().max().item()
            ms = median_ms(lambda fn=fn, args=args: fn(*args), max(3, repeats // 5))
            print(
                f"  prefill {str(dtype)[6:]:8s} {name:22s} {impl:9s} {ms:8.3f} ms/layer   max|err| {err:.1e}"
            )


def bench_copies(dtype: torch.dtype, repeats: int) -> None:
    num_kv_heads, head_dim, num_tokens = 3, 64, 512
    k_cache, v_cache, _ = make_pool(64, 600, num_kv_heads, head_dim, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE)[:num_tokens]

    def write_index_put() -> None:
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v

    ids = torch.randperm(k_cache.shape[0])[:600]
    buf = reference.gather_blocks(k_cache, ids)
    gathered_mb = buf.numel() * buf.element_size() / 1e6

    def gather_indexing() -> torch.Tensor:
        return k_cache[ids]

    def scatter_indexing() -> None:
        k_cache[ids] = buf

    for name, fn in (
        (
            "write_kv index_copy_ (512 tok)",
            lambda: reference.write_kv(k_cache, v_cache, k, v, slots),
        ),
        ("write_kv view[slots] = k", write_index_put),
        (
            f"gather index_select ({gathered_mb:.1f} MB)",
            lambda: reference.gather_blocks(k_cache, ids),
        ),
        ("gather cache[ids]", gather_indexing),
        ("scatter index_copy_", lambda: reference.scatter_blocks(k_cache, ids, buf)),
        ("scatter cache[ids] = buf", scatter_indexing),
    ):
        print(f"  {str(dtype)[6:]:8s} {name:34s} {median_ms(fn, repeats):8.3f} ms")


# The default model (SmolLM2-135M): (N, K) of each layer's projections, and the tied lm_head.
LAYER_LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def bench_linear(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    """One decode step's projections at each row count, C and torch alternating per repeat."""
    shapes = [shape for _ in range(NUM_LAYERS) for shape in LAYER_LINEARS] + [LM_HEAD]
    weights = [(torch.randn(n, k) / k**0.5).to(dtype) for n, k in shapes]
    weight_gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    name = str(dtype)[6:]
    c_faster = []
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}
        x0, w0 = xs[weights[0].shape[1]], weights[0]
        times: dict[Callable, list[float]] = {gemm.linear: [], F.linear: []}
        with mock.patch.dict(gemm.LINEAR_MAX_ROWS, {dtype: m}):  # the C kernel whatever m
            err = (gemm.linear(x0, w0).double() - F.linear(x0, w0).double()).abs().max().item()
            for _ in range(repeats + 1):  # the first round warms up
                for fn, ms in times.items():
                    start = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    ms.append((time.perf_counter() - start) * 1e3)
        c_ms, torch_ms = (statistics.median(ms[1:]) for ms in times.values())
        if c_ms < torch_ms:
            c_faster.append(m)
        print(
            f"  linear {name:8s} M={m:<3d} C {c_ms:7.1f} ms {weight_gb / c_ms * 1e3:5.1f} GB/s   "
            f"torch {torch_ms:7.1f} ms {weight_gb / torch_ms * 1e3:5.1f} GB/s   "
            f"C/torch {c_ms / torch_ms:4.2f}   max|C - torch| {err:.1e}"
        )
    packed = dtype == torch.bfloat16 and gemm._packing() is not None
    threshold = (
        "packed weights: C at every M"
        if packed
        else f"gemm.LINEAR_MAX_ROWS: {gemm.LINEAR_MAX_ROWS.get(dtype)}"
    )
    print(
        f"  linear {name:8s} {weight_gb * 1e3:.0f} MB of weights; C faster at M={c_faster} ({threshold})"
    )


def bench_quant(rows: list[int], repeats: int, threads: int, baseline: str | None) -> None:
    """One decode step's quantized projections per format, build and row count; this tree's
    quant.c against ``baseline``'s (if given), alternating repeat by repeat."""
    shapes = [shape for _ in range(NUM_LAYERS) for shape in LAYER_LINEARS] + [LM_HEAD]
    for fmt in ("q4_1", "q4_0", "q8_0"):
        weights = [quantized.quantize(torch.randn(n, k) / k**0.5, fmt) for n, k in shapes]
        weight_gb = sum(w.data.numel() for w in weights) / 1e9
        for isa in ("native", "avx2"):
            libs = {"this": quant.library(isa)}
            if baseline:
                libs["baseline"] = quant.load(Path(baseline), isa)
            for m in rows:
                xs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
                ys = {n: torch.empty(m, n) for n in {n for n, _ in shapes}}
                calls = [
                    (xs[k].data_ptr(), w.data.data_ptr(), w.qtype, ys[n].data_ptr(), n, k)
                    for w, (n, k) in zip(weights, shapes, strict=True)
                ]
                times: dict[str, list[float]] = {name: [] for name in libs}
                lib = libs["this"]
                copies = [quant.integer_copy(w, lib) for w in weights]
                integer = m <= quant.integer_rows(lib) and all(v is not None for v in copies)
                if integer:  # this tree's integer path (Q4_1, fp32 x) on the same weights
                    times["integer"] = []
                for _ in range(repeats + 1):  # the first round warms up
                    for name, lib in libs.items():
                        fn = lib.pdserve_qlinear
                        start = time.perf_counter()
                        for x, w, qt, y, n, k in calls:
                            fn(x, w, qt, None, None, y, m, n, k, 0, threads)
                        times[name].append((time.perf_counter() - start) * 1e3)
                    if integer:
                        fn = libs["this"].pdserve_qlinear_v
                        start = time.perf_counter()
                        for (x, _, _, y, n, k), v, w in zip(calls, copies, weights, strict=True):
                            if fn(x, v.data_ptr(), w.qtype, None, y, m, n, k, threads):
                                raise RuntimeError(f"pdserve_qlinear_v refused {w.qtype} {n}x{k}")
                        times["integer"].append((time.perf_counter() - start) * 1e3)
                ms = {name: statistics.median(t[1:]) for name, t in times.items()}
                line = f"  quant {fmt} {isa:6s} M={m:<2d} this {ms['this']:6.2f} ms "
                line += f"{weight_gb / ms['this'] * 1e3:5.1f} GB/s"
                if integer:
                    line += f"   integer {ms['integer']:6.2f} ms "
                    line += f"{weight_gb / ms['integer'] * 1e3:5.1f} GB/s"
                if baseline:
                    line += f"   baseline {ms['baseline']:6.2f} ms "
                    line += f"{weight_gb / ms['baseline'] * 1e3:5.1f} GB/s"
                    line += f"   baseline/this {ms['baseline'] / ms['this']:4.2f}x"
                print(line + f"   ({weight_gb * 1e3:.0f} MB)", flush=True)


SECTIONS = ("attention", "prefill", "copies", "linear", "quant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--only", choices=SECTIONS, action="append", help="repeatable")
    parser.add_argument(
        "--linear-rows", default="1,2,4,8,16,32", help="rows of x (tokens) for the linear section"
    )
    parser.add_argument("--quant-rows", default="1,2,4", help="rows of x for the quant section")
    parser.add_argument("--quant-baseline", help="another quant.c to compare (quant section)")
    args = parser.parse_args()
    sections = args.only or SECTIONS
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} threads, C kernels: "
        f"attention {ops.native_available()}, linear {gemm.linear_available()}"
    )
    dtypes = (torch.float32, torch.bfloat16)
    for dtype in dtypes if "attention" in sections else ():
        bench_decode(dtype, args.repeats)
    if "attention" in sections:  # bf16 where it is the default, fp32 elsewhere; and batch 1
        for dtype, num_seqs in ((torch.bfloat16, 32), (torch.float32, 32), (torch.float32, 1)):
            bench_decode_cold(dtype, args.repeats, num_seqs)
            if dtype == torch.float32:  # and over bf16 pools (--kv-cache-dtype bfloat16)
                bench_decode_cold(dtype, args.repeats, num_seqs, kv_dtype=torch.bfloat16)
    for dtype in dtypes if "prefill" in sections else ():
        bench_prefill(dtype, args.repeats)
    for dtype in dtypes if "copies" in sections else ():
        bench_copies(dtype, args.repeats)
    rows = [int(m) for m in args.linear_rows.split(",")]
    for dtype in dtypes if "linear" in sections else ():
        bench_linear(dtype, rows, max(3, args.repeats // 10))
    if "quant" in sections:
        quant_rows = [int(m) for m in args.quant_rows.split(",")]
        bench_quant(quant_rows, max(3, args.repeats // 5), args.threads, args.quant_baseline)


if __name__ == "__main__":
    main()
