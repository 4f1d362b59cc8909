"""Kernel micro-benchmarks on CPU (print only): python -m bench.kernels [--threads N].

Decode attention for 32 sequences x 600 tokens, 9 heads / 3 kv heads / head_dim 64 (the default
model's layer), blocks of 16 in shuffled order: reference vs the C kernel vs a "gather then bmm"
baseline, ms per layer and GB/s of K/V read. Then prefill attention and the KV write/transfer ops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: bench/ is on sys.path and this file would shadow `kernels`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.cpu import ops  # noqa: E402

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
            ("cpu SDPA", ops.prefill_attention),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, C kernel: {ops.native_available()}")
    for dtype in (torch.float32, torch.bfloat16):
        bench_decode(dtype, args.repeats)
    for dtype in (torch.float32, torch.bfloat16):
        bench_prefill(dtype, args.repeats)
    for dtype in (torch.float32, torch.bfloat16):
        bench_copies(dtype, args.repeats)


if __name__ == "__main__":
    main()
