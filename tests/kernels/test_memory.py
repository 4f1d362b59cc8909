"""kernels.cpu.memory: huge-page backed CPU buffers."""

import ctypes
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pdserve.kernels.cpu import memory

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


thp = pytest.mark.skipif(
    _thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here"
)


def _apart(script: str):
    """What ``script`` prints (JSON), run in a process of its own: in this one, memory freed by
    earlier tests (written, so mapped) may be handed out again."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_large_buffer_is_aligned_and_usable(dtype):
    t = memory.empty((5, 1 << 20), dtype)
    assert t.shape == (5, 1 << 20) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    t.fill_(3)
    assert t.sum(dtype=torch.float64).item() == 3 * t.numel()


def test_small_buffer_is_plain():
    t = memory.empty(100, torch.float32)
    assert t.shape == (100,)
    t.copy_(torch.arange(100.0))
    assert t[99].item() == 99


@thp
def test_kernel_takes_the_advice():
    t = memory.empty(8 * memory.HUGE_PAGE, torch.uint8)
    assert memory.advise_huge_pages(t)
    # a buffer smaller than one aligned huge page has nothing to advise
    assert not memory.advise_huge_pages(torch.empty(4096, dtype=torch.uint8))


def _resident_fraction(t: torch.Tensor) -> float:
    """The share of ``t``'s pages that are mapped (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // memory.PAGE * memory.PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(end - start) // memory.PAGE)
    vec = (ctypes.c_ubyte * n)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) / n


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, madvise: Linux")


POOLS = """
import json, torch
from tests.kernels.test_memory import _resident_fraction
from pdserve.kernels.cpu import memory
shape = (2048, 16, 3, 64)  # 12 MiB of bf16
lazy = memory.empty_pool(shape, torch.bfloat16, "cpu")
resident = memory.empty_pool(shape, torch.bfloat16, "cpu", resident=True)
print(json.dumps([_resident_fraction(lazy), _resident_fraction(resident),
                  resident.data_ptr() % memory.HUGE_PAGE]))
"""


@linux
def test_a_resident_pool_is_mapped_before_its_first_write():
    lazy, resident, misaligned = _apart(POOLS)
    assert lazy < 0.5  # nothing written yet
    assert resident == 1.0 and misaligned == 0


@linux
def test_making_memory_resident_keeps_what_it_holds():
    t = memory.empty((3, 1 << 20), torch.float32)
    t[1].copy_(torch.arange(1 << 20, dtype=torch.float32))
    memory.make_resident(t)
    assert _resident_fraction(t) == 1.0
    assert torch.equal(t[1], torch.arange(1 << 20, dtype=torch.float32))


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``t``'s first whole huge page."""
    addr = -(-t.data_ptr() // memory.HUGE_PAGE) * memory.HUGE_PAGE
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


AFTER_A_HEAP_HOLE = """
import json, torch
from tests.kernels.test_memory import _huge_kib
from pdserve.kernels.cpu import memory
big = torch.empty(30 << 20, dtype=torch.uint8)
del big  # malloc now serves up to 30 MB from its heap
written = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(48)]
del written  # 48 MB of the heap mapped on small pages, free again
large = memory.empty(20 << 20, torch.uint8)
weight = memory.weights_empty(1 << 20, torch.uint8)
large.fill_(1), weight.fill_(1)
print(json.dumps([_huge_kib(large), _huge_kib(weight)]))
"""


@thp
def test_huge_page_buffers_are_new_memory_not_the_heaps_written_pages():
    """malloc handed a freed, written heap region back to memory.empty, whose pages then stayed
    small whatever the advice (a worker's decode weights were found so)."""
    large, weight = _apart(AFTER_A_HEAP_HOLE)
    assert large >= 16 << 10  # KiB: most of its 20 MiB
    assert weight >= 2 << 10  # the huge page its 1 MiB was written to


def test_weights_are_carved_side_by_side_from_one_slab():
    if memory._madvise() is None:
        pytest.skip("no madvise here: weights_empty is torch.empty")
    memory._slabs._slab = None  # a new slab for this test
    a = memory.weights_empty((300, 250), torch.float32)  # 300,000 bytes
    b = memory.weights_empty(1000, torch.uint8)
    c = memory.weights_empty((7, 3), torch.bfloat16)
    slab = memory._slabs._slab
    assert slab.data_ptr() % memory.HUGE_PAGE == 0
    assert a.data_ptr() == slab.data_ptr()
    assert b.data_ptr() == a.data_ptr() + 300_032  # 64-byte aligned, right after a
    assert c.data_ptr() == b.data_ptr() + 1024
    a.fill_(1.5), b.fill_(7), c.fill_(-2)
    assert a.sum().item() == 1.5 * a.numel() and b.sum().item() == 7 * 1000
    assert (c == -2).all() and a.shape == (300, 250) and c.dtype == torch.bfloat16
    # a buffer of half a slab or more is one of its own; the slab goes on being carved
    whole = memory.weights_empty(memory._Slabs.SLAB // 2, torch.uint8)
    assert whole.data_ptr() % memory.HUGE_PAGE == 0 and memory._slabs._slab is slab
    # the rest of a slab too small: a new one
    memory.weights_empty(memory._Slabs.SLAB // 2 - 1, torch.uint8)
    assert memory._slabs._slab is slab
    memory.weights_empty(memory._Slabs.SLAB // 2 - 1, torch.uint8)
    assert memory._slabs._slab is not slab


def test_a_weights_copy_holds_the_same_values():
    w = torch.randn(96, 64, dtype=torch.float32)
    copy = memory.weights_copy(w)
    assert torch.equal(copy, w) and copy.data_ptr() != w.data_ptr() and copy.is_contiguous()
    assert memory.weights_empty(0, torch.float32).numel() == 0


def _failing_madvise(err: int):
    def madvise(addr, length, advice):
        ctypes.set_errno(err)
        return -1

    return madvise


def test_without_the_kernel_call_the_memory_is_written(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: _failing_madvise(errno.EINVAL))
    t = memory.empty(1 << 20, torch.float32)
    t.fill_(7)
    memory.make_resident(t)  # a kernel before 5.14: zeros written instead
    assert not t.any()


def test_memory_that_is_not_there_fails_at_once(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: _failing_madvise(errno.ENOMEM))
    with pytest.raises(MemoryError, match="could not be made resident: Cannot allocate memory"):
        memory.empty_pool((64, 16, 3, 64), torch.float32, "cpu", resident=True)


def test_the_reference_pool_made_resident_is_zeroed():
    from pdserve.kernels import reference

    pool = reference.empty_pool((4, 16, 3, 64), torch.float32, torch.device("cpu"), resident=True)
    assert pool.shape == (4, 16, 3, 64) and not pool.any()


def test_a_pool_that_would_not_fit_in_the_memory_left_is_refused_at_once(
    monkeypatch, default_model_dir
):
    """A pool larger than the memory left was killed by the kernel while mapping it (SIGKILL,
    no word why)."""
    from pdserve.kv_cache import pool
    from pdserve.model.config import ModelConfig

    model, cpu = ModelConfig.from_file(default_model_dir / "config.json"), torch.device("cpu")
    nbytes = pool.bytes_per_block(model, 16, torch.float32) * 16  # 11.25 MiB
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: nbytes - 1)
    with pytest.raises(ValueError, match=r"a KV cache of 0\.0 GiB does not fit in the 0\.0 GiB"):
        pool.KVCachePool(model, 16, 16, torch.float32, cpu, resident=True)
    pool.KVCachePool(model, 16, 16, torch.float32, cpu, resident=False)  # mapped as it fills
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: nbytes)
    made = pool.KVCachePool(model, 16, 16, torch.float32, cpu, resident=True)
    assert made.kv_caches[0][0].shape == (16, 16, model.num_kv_heads, model.head_dim)


@linux
def test_the_memory_left_is_what_the_machine_has_at_most():
    from pdserve.kv_cache.pool import available_memory_bytes

    left = available_memory_bytes()
    assert left is not None and 0 < left <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize(
    "limit, expected_gib", [("4294967296", 2), ("max", 8)], ids=["cgroup limit", "no limit"]
)
def test_the_memory_left_is_the_machines_and_within_a_containers_limit(
    monkeypatch, tmp_path, limit, expected_gib
):
    from pdserve.kv_cache import pool

    gib = 1 << 30
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    (tmp_path / "memory.max").write_text(f"{limit}\n")
    (tmp_path / "memory.current").write_text(f"{3 * gib}\n")  # 1 GiB of it reclaimable cache
    (tmp_path / "memory.stat").write_text(f"anon {2 * gib}\ninactive_file {gib}\n")
    monkeypatch.setattr(pool, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(pool, "CGROUP", str(tmp_path))
    assert pool.available_memory_bytes() == expected_gib * gib
    monkeypatch.setattr(pool, "MEMINFO", str(tmp_path / "none"))
    monkeypatch.setattr(pool, "CGROUP", str(tmp_path / "none"))
    assert pool.available_memory_bytes() is None


def _in_a_slab(t: torch.Tensor) -> bool:
    slab = memory._slabs._slab
    return slab is not None and 0 <= t.data_ptr() - slab.data_ptr() < slab.numel()


def test_prepacking_moves_what_the_kernels_read_onto_slabs():
    """The loader's prepack_linear: a quantized weight's blocks and an fp32 weight that no packing
    replaces move to weights_empty's memory, values and results unchanged."""
    if memory._madvise() is None:
        pytest.skip("no madvise here: weights_empty is torch.empty")
    from pdserve.kernels import quantized
    from pdserve.kernels.cpu import gemm, quant

    memory._slabs._slab = None
    dense = torch.randn(64, 96) / 10
    qw = quantized.quantize(dense, "q4_1")
    blocks = qw.data.clone()
    x = torch.randn(3, 96)
    before = quant.linear(x, qw)
    gemm.prepack_linear(qw, torch.float32)
    assert torch.equal(qw.data, blocks) and _in_a_slab(qw.data)
    assert torch.equal(quant.linear(x, qw), before)
    param = torch.nn.Parameter(dense.clone(), requires_grad=False)
    gemm.prepack_linear(param, torch.float32)
    assert torch.equal(param, dense) and _in_a_slab(param)


def test_a_mapping_the_system_refuses_is_a_memory_error(monkeypatch):
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="could not be mapped: Cannot allocate memory"):
        memory._fresh(64 << 20)
