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


@pytest.mark.skipif(
    _thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here"
)
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
    # in a process of its own: in this one, memory freed by earlier tests (written, so mapped)
    # may be handed out again
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", POOLS], capture_output=True, text=True, check=True, cwd=root
    ).stdout
    lazy, resident, misaligned = json.loads(out)
    assert lazy < 0.5  # nothing written yet
    assert resident == 1.0 and misaligned == 0


@linux
def test_making_memory_resident_keeps_what_it_holds():
    t = memory.empty((3, 1 << 20), torch.float32)
    t[1].copy_(torch.arange(1 << 20, dtype=torch.float32))
    memory.make_resident(t)
    assert _resident_fraction(t) == 1.0
    assert torch.equal(t[1], torch.arange(1 << 20, dtype=torch.float32))


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
