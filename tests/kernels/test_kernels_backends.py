"""Every kernel backend against the reference, and the reference against dense float64 attention.

Backends run where they can: the reference and the C/SDPA CPU path on CPU tensors, the Triton
kernels on CPU tensors under the Triton interpreter (no CUDA) and on CUDA tensors (``gpu``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch
from pdserve.kernels import reference

from tests.gpu import GPU, HAS_CUDA

if not HAS_CUDA:
    # Test setup: @triton.jit picks the interpreter when kernels.triton is imported (lazily, below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = [
    pytest.param("reference", "cpu", id="reference-cpu"),
    pytest.param("cpu", "cpu", id="cpu"),
    pytest.param("triton", "cpu", id="triton-interpreter"),
    pytest.param("triton", "cuda", id="triton-cuda", marks=GPU),
    pytest.param("reference", "cuda", id="reference-cuda", marks=GPU),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
HEADS = [  # (num_heads, num_kv_heads, head_dim)
    pytest.param((9, 3, 64), id="gqa9-3-64"),
    pytest.param((4, 4, 32), id="mha4-4-32"),
    pytest.param((6, 2, 20), id="gqa6-2-20"),  # head_dim not a multiple of 8 (C tail loops)
]
# Ragged lengths on and off block boundaries (block_size 16), in one batch.
CONTEXT_LENS = [1, 15, 16, 17, 33, 100]


def load_backend(name: str, device: str) -> ModuleType:
    if name == "triton":
        pytest.importorskip("triton")
        module = importlib.import_module("pdserve.kernels.triton")
        interpreted = (
            type(module.decode_attention._paged_decode_kernel).__name__ == "InterpretedFunction"
        )
        if device == "cpu" and not interpreted:
            pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before import)")
        if device == "cuda" and interpreted:
            pytest.skip("kernels.triton was imported under TRITON_INTERPRET=1")
        return module
    module = importlib.import_module(f"pdserve.kernels.{name}")
    if name == "cpu" and not module.native_available():
        pytest.skip(
            "the C kernel did not build here (see the warning); cpu falls back to reference"
        )
    return module


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_paged_decode_attention(backend, device, dtype, heads, paged_case, dense, close):
    num_heads, num_kv_heads, head_dim = heads
    kernels = load_backend(backend, device)
    case = paged_case(CONTEXT_LENS, num_kv_heads, head_dim, 16, dtype, device=device)
    scale = head_dim**-0.5
    # q as a strided view of a packed qkv row, as the model produces it
    qkv = torch.randn(len(CONTEXT_LENS), num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    q = qkv.to(device)[:, :num_heads]
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale)

    out = kernels.paged_decode_attention(*args)

    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    close(out, reference.paged_decode_attention(*args), dtype)
    close(out, dense(q, case.seq_k, case.seq_v, [1] * len(CONTEXT_LENS), scale), dtype)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_blocks_longer_than_a_tile(backend, device, dtype, paged_case, dense, close):
    """Block size 64: the C kernel splits blocks into 32-token tiles."""
    kernels = load_backend(backend, device)
    lens = [31, 32, 33, 64, 65, 130]
    case = paged_case(lens, 2, 32, 64, dtype, device=device)
    q = torch.randn(len(lens), 4, 32).to(dtype).to(device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 32**-0.5)
    out = kernels.paged_decode_attention(*args)
    close(out, dense(q, case.seq_k, case.seq_v, [1] * len(lens), 32**-0.5), dtype)


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=GPU)]
)
@pytest.mark.parametrize("splits", [2, 3, 8, 32])
def test_triton_decode_split_along_the_context(
    device, splits, paged_case, dense, close, monkeypatch
):
    """The context shared among several programs, combined after: more splits than a short
    sequence has blocks (empty splits), uneven shares, and a padding row with no context."""
    kernels = load_backend("triton", device)
    lens = [*CONTEXT_LENS, 0]
    case = paged_case(lens[:-1], 3, 64, 16, torch.bfloat16, device=device)
    q = torch.randn(len(lens), 9, 64).to(torch.bfloat16).to(device)
    tables = torch.cat([case.block_tables, case.block_tables[:1]])
    context_lens = torch.cat([case.context_lens, case.context_lens.new_zeros(1)])
    args = (q, case.k_cache, case.v_cache, tables, context_lens, 64**-0.5)
    monkeypatch.setenv("PDSERVE_DECODE_SPLITS", str(splits))
    assert kernels.decode_attention.num_splits_for(len(lens), 3, q.device) == splits
    out = kernels.paged_decode_attention(*args)
    want = dense(q[:-1], case.seq_k, case.seq_v, [1] * len(CONTEXT_LENS), 64**-0.5)
    close(out[:-1], want, torch.bfloat16)
    assert torch.equal(out[-1].float(), torch.zeros_like(out[-1].float()))


@pytest.mark.parametrize("value", ["0", "33"])
def test_a_decode_split_count_out_of_range_is_a_clear_error(value, monkeypatch):
    kernels = load_backend("triton", "cpu")
    monkeypatch.setenv("PDSERVE_DECODE_SPLITS", value)
    with pytest.raises(ValueError, match=f"PDSERVE_DECODE_SPLITS={value}: allowed 1 to 32"):
        kernels.decode_attention.num_splits_for(1, 3, torch.device("cpu"))


# (new tokens, cached prefix) per sequence, packed into one batch
PREFILL_NO_PREFIX = [(1, 0), (15, 0), (16, 0), (17, 0), (40, 0)]
PREFILL_CHUNKED = [(7, 9), (5, 16), (16, 16), (33, 67), (1, 99)]


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS[:2])
@pytest.mark.parametrize(
    "seqs", [PREFILL_NO_PREFIX, PREFILL_CHUNKED], ids=["no-prefix", "cached-prefix"]
)
def test_prefill_attention(backend, device, dtype, heads, seqs, paged_case, dense, close):
    num_heads, num_kv_heads, head_dim = heads
    kernels = load_backend(backend, device)
    q_lens = [n for n, _ in seqs]
    case = paged_case([n + p for n, p in seqs], num_kv_heads, head_dim, 16, dtype, device=device)
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype).to(device)
    query_start_loc = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
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

    out = kernels.prefill_attention(*args)
    bounded = kernels.prefill_attention(*args, max(q_lens))  # the runner's host-side bound

    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(bounded, out)
    close(out, reference.prefill_attention(*args), dtype)
    close(out, dense(q, case.seq_k, case.seq_v, q_lens, scale), dtype)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_reused_prefix_blocks(backend, device, dtype, paged_case, dense, close):
    """Three sequences share sequence 0's first two blocks (a cached prompt prefix)."""
    kernels = load_backend(backend, device)
    seqs = [(40, 0), (9, 32), (20, 32)]  # (new tokens, prefix); 32 = two shared blocks
    q_lens = [n for n, _ in seqs]
    case = paged_case(
        [n + p for n, p in seqs], 3, 64, 16, dtype, device=device, shared_prefix_blocks=2
    )
    assert torch.equal(case.block_tables[1, :2], case.block_tables[0, :2])
    q = torch.randn(sum(q_lens), 9, 64).to(dtype).to(device)
    query_start_loc = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    args = (
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        query_start_loc,
        case.context_lens,
        0.125,
    )
    close(kernels.prefill_attention(*args), dense(q, case.seq_k, case.seq_v, q_lens, 0.125), dtype)


def test_wrong_gqa_mapping_is_caught(paged_case, dense):
    """The data discriminate: h % num_kv_heads instead of h // group is far outside tolerance."""
    case = paged_case(CONTEXT_LENS, 3, 64, 16, torch.float32)
    q = torch.randn(len(CONTEXT_LENS), 9, 64)
    out = reference.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    wrong = dense(
        q, case.seq_k, case.seq_v, [1] * len(CONTEXT_LENS), 0.125, kv_head_of="h % num_kv_heads"
    )
    assert (out.double() - wrong).abs().max() > 0.1


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_then_decode(backend, device, dtype, dense, close):
    """Tokens written through slot_mapping land where decode (and the block table) expect them."""
    kernels = load_backend(backend, device)
    num_blocks, block_size, num_kv_heads, head_dim = 12, 16, 3, 64
    lens = [17, 40]
    block_tables = torch.tensor([[7, 2, 0], [5, 11, 3]], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    seq_k = [torch.randn(n, num_kv_heads, head_dim).to(dtype) for n in lens]
    seq_v = [torch.randn(n, num_kv_heads, head_dim).to(dtype) for n in lens]
    positions = [torch.arange(n) for n in lens]
    slots = torch.cat(
        [
            block_tables[s, p // block_size].long() * block_size + p % block_size
            for s, p in enumerate(positions)
        ]
    )
    # a strided view, as k and v come out of a packed qkv projection
    kv = torch.cat([torch.cat(seq_k), torch.cat(seq_v)], dim=1).to(device)
    kernels.write_kv(k_cache, v_cache, kv[:, :num_kv_heads], kv[:, num_kv_heads:], slots.to(device))

    expected_k = torch.zeros(shape, dtype=dtype)
    expected_k.view(-1, num_kv_heads, head_dim)[slots] = torch.cat(seq_k)
    assert torch.equal(k_cache.cpu(), expected_k)

    q = torch.randn(len(lens), 9, head_dim).to(dtype).to(device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables.to(device), context_lens, 0.125
    )
    seq_k64 = [k.double() for k in seq_k]
    seq_v64 = [v.double() for v in seq_v]
    close(out, dense(q, seq_k64, seq_v64, [1, 1], 0.125), dtype)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_round_trip(backend, device, dtype):
    kernels = load_backend(backend, device)
    cache = torch.randn(10, 16, 3, 64).to(dtype).to(device)
    ids = torch.tensor([7, 2, 9, 0], device=device)

    buf = kernels.gather_blocks(cache, ids)

    assert buf.shape == (4, 16, 3, 64) and buf.is_contiguous() and buf.dtype == dtype
    assert torch.equal(buf.cpu(), cache.cpu()[[7, 2, 9, 0]])
    other = torch.zeros_like(cache)
    dst = torch.tensor([1, 5, 3, 8], device=device)
    kernels.scatter_blocks(other, dst, buf)
    assert torch.equal(other.cpu()[[1, 5, 3, 8]], buf.cpu())
    assert not other.cpu()[[0, 2, 4, 6, 7, 9]].any()
    assert torch.equal(kernels.gather_blocks(other, dst).cpu(), buf.cpu())
