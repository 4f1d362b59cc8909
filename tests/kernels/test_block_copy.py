"""The C block gather/scatter (kernels/cpu/block_copy.c): byte-exact against torch's indexing for
runs of every length, ids out of range rejected before anything is written, fallbacks."""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch
from pdserve.kernels.cpu import block_copy, ops

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# runs of consecutive ids of every length, reversed pairs, a lone block at each end of the pool
IDS = [0, 1, 2, 3, 9, 5, 6, 12, 13, 11, 19, 17, 18, 4]


def pool(dtype: torch.dtype, blocks: int = 20) -> torch.Tensor:
    return torch.randn(blocks, 16, 3, 64).to(dtype)


@needs_compiler
def test_the_library_builds_here() -> None:
    assert block_copy.library() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "ids", [IDS, list(range(7, 19)), [5], []], ids=["mixed", "one-run", "one", "none"]
)
def test_gather_and_scatter_match_torch_byte_for_byte(dtype: torch.dtype, ids: list[int]) -> None:
    cache = pool(dtype)
    t = torch.tensor(ids, dtype=torch.long)
    buf = block_copy.gather_blocks(cache, t)
    assert buf.shape == (len(ids), 16, 3, 64) and buf.dtype == dtype
    assert torch.equal(buf.view(torch.uint8), cache[t].view(torch.uint8))

    into = torch.full_like(buf, 7)
    assert block_copy.gather_blocks_into(cache, ids, into) is into
    assert torch.equal(into.view(torch.uint8), buf.view(torch.uint8))

    other = torch.zeros_like(cache)
    block_copy.scatter_blocks(other, t.to(torch.int32), buf)
    want = torch.zeros_like(cache)
    want.index_copy_(0, t, buf)
    assert torch.equal(other.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    "shape", [(3, 5), (1,), (64, 3)], ids=["30-byte-blocks", "2-byte", "384-byte"]
)
def test_blocks_of_any_size_and_alignment_scatter_exactly(shape: tuple[int, ...]) -> None:
    """The streaming stores cover whole aligned 64-byte lines; heads and tails of runs that are
    not whole lines (and runs shorter than a line) are copied plainly, and nothing around them
    is touched."""
    cache = torch.randn(40, *shape).to(torch.float16)
    for ids in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 30], [39, 0, 1, 2], [20]):
        t = torch.tensor(ids)
        buf = torch.randn(len(ids), *shape).to(torch.float16)
        other = cache.clone()
        block_copy.scatter_blocks(other, t, buf)
        want = cache.clone()
        want[t] = buf
        assert torch.equal(other.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(
            block_copy.gather_blocks(other, t).view(torch.uint8), buf.view(torch.uint8)
        )


def test_ops_exports_them_with_the_reference_signatures() -> None:
    assert ops.gather_blocks is block_copy.gather_blocks
    assert ops.scatter_blocks is block_copy.scatter_blocks


@needs_compiler
@pytest.mark.parametrize("bad", [20, -1])
def test_ids_out_of_range_raise_and_write_nothing(bad: int) -> None:
    cache = pool(torch.bfloat16)
    before = cache.clone()
    with pytest.raises(IndexError, match=r"1 block ids outside \[0, 20\)"):
        block_copy.scatter_blocks(
            cache, torch.tensor([3, bad, 4]), torch.zeros(3, 16, 3, 64).to(torch.bfloat16)
        )
    assert torch.equal(cache, before)
    out = torch.zeros(3, 16, 3, 64).to(torch.bfloat16)
    with pytest.raises(IndexError):
        block_copy.gather_blocks_into(cache, [3, bad, 4], out)
    assert not out.any()
    with pytest.raises(ValueError, match="out holds 2 blocks"):
        block_copy.gather_blocks_into(cache, [3, 4, 5], out[:2])


def test_what_the_c_code_does_not_cover_goes_to_torch() -> None:
    cache = pool(torch.float32)
    strided = cache.transpose(1, 2)  # not contiguous
    buf = block_copy.gather_blocks(strided, torch.tensor([4, 2]))
    assert torch.equal(buf, strided[[4, 2]])
    other = torch.zeros(20, 16, 3, 64, dtype=torch.bfloat16)  # another dtype: converted
    block_copy.scatter_blocks(other, torch.tensor([1, 0]), cache[:2])
    assert torch.equal(other[[1, 0]], cache[:2].to(torch.bfloat16))


def test_without_a_compiler_torch_does_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "library", lambda: None)
    cache = pool(torch.bfloat16)
    buf = block_copy.gather_blocks(cache, torch.tensor(IDS))
    assert torch.equal(buf, cache[IDS])
    other = torch.zeros_like(cache)
    block_copy.scatter_blocks(other, torch.tensor(IDS), buf)
    assert torch.equal(other[IDS], buf)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_transfer_copies_match_torch_byte_for_byte(backend: str, dtype: torch.dtype) -> None:
    """The KV transfer's copies of every backend: a layer gathered into a message buffer, then
    written in two chunks into other blocks of every layer's pools; beyond the ids: IndexError."""
    kernels = importlib.import_module(f"pdserve.kernels.{backend}")
    src_k, src_v = pool(dtype), pool(dtype)
    ids = torch.tensor(IDS, dtype=torch.long)
    k, v = (
        torch.empty(len(IDS), 16, 3, 64, dtype=dtype),
        torch.empty(len(IDS), 16, 3, 64, dtype=dtype),
    )
    kernels.gather_kv_blocks(src_k, src_v, ids, k, v)
    assert torch.equal(k.view(torch.uint8), src_k[ids].view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), src_v[ids].view(torch.uint8))

    k_pools = [torch.zeros(20, 16, 3, 64, dtype=dtype) for _ in range(2)]
    v_pools = [torch.zeros_like(p) for p in k_pools]
    dst = list(reversed(IDS))
    write = kernels.kv_block_writer(k_pools, v_pools, dst)
    write(1, 0, k[:5].contiguous(), v[:5].contiguous())
    write(1, 5, k[5:].contiguous(), v[5:].contiguous())
    assert torch.equal(k_pools[1][dst].view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v_pools[1][dst].view(torch.uint8), v.view(torch.uint8))
    assert not k_pools[0].any() and not v_pools[0].any()
    with pytest.raises(IndexError, match="beyond the 14 block ids"):
        write(0, 10, k[:5].contiguous(), v[:5].contiguous())

    empty = kernels.empty_pool((3, 16, 3, 64), dtype, torch.device("cpu"))
    assert empty.shape == (3, 16, 3, 64) and empty.dtype == dtype and empty.is_contiguous()
