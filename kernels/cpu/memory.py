"""Large CPU buffers on transparent huge pages (2 MiB) where the kernel allows it.

A decode step reads every packed weight and, at batch 32 with 512-token contexts, ~400 MB of KV
blocks scattered over the pool: with 4 KiB pages that is ~100k pages per step, most of them TLB
misses. Where the kernel's THP mode is ``madvise`` (the default of many distributions, and of
the 2-core Zen 4 these kernels were measured on), memory gets huge pages only when asked for
before it is first touched. ``empty`` asks (``madvise(MADV_HUGEPAGE)``); elsewhere (mode
``always`` or ``never``, other systems) it is a plain ``torch.empty``.

Measured on that machine, 32 sequences decoding at 512-580 tokens of context, both variants in
one process, steps alternating: 0.96-0.98x the step time with the KV pool on huge pages, another
0.98x with the packed weights on them too.

A model's weights are many buffers, most smaller than a huge page is worth padding for (the
default model's 120 projections are 0.2-1.1 MB each in Q4_1), so ``weights_empty`` carves them
out of shared slabs on huge pages instead (``_Slabs``): the weights a decode step streams then sit
on ~50 huge pages rather than ~25,000 small ones. Measured on a 2-vCPU Xeon without AVX512-BF16
(family 6 model 207), the default model's 120 Q4_1 projections and its Q8_0 lm_head (96 MB, the
integer path, one row of x), both copies in one process, alternating: 0.89x the time on slabs
with 2 threads (4.42 against 4.98 ms), 0.82x with 1 (docs/benchmarks.md).

A worker's KV pool is made resident when it starts (``make_resident``), not as blocks are first
written. Left to its first writes, each new page was mapped and zeroed in the serving path: in a
decode worker, inside the UCX thread that lands a prompt's KV (66 % of that thread's time in the
kernel's ``clear_page_erms`` over a W-c32 run on a 2-core Zen 5), beside the engine on the same
core. There, populating a 2 GiB pool up front took 0.11 s against 0.9-2.0 s for first writes
to it, and W-c32 ran 1.08x faster under ``pdserve up``, 1.12x colocated (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import math
import mmap
import os
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
PAGE = 4096
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23
_MIN_BYTES = 4 * HUGE_PAGE  # smaller buffers are not worth the padding


@functools.cache
def _libc(name: str):
    """``name`` from the C library (Linux only), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _madvise():
    fn = _libc("madvise")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def release_freed_heap() -> bool:
    """Give the pages the C heap holds free back to the system (glibc's ``malloc_trim``). Loading
    a model frees its dense copies (fp32 projections replaced by quantized blocks) in pieces of a
    few MB, which the heap keeps: ~370 MB of the default model's GGUF load on the CPU stayed
    resident for the process's life. True if memory was released."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages for the whole 2 MiB pages inside ``t``'s memory (not yet touched memory
    gets them as it is first written). True if the kernel took the advice."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    return last > first and madvise(first, last - first, _MADV_HUGEPAGE) == 0


def _shape_bytes(shape: tuple[int, ...] | int, dtype: torch.dtype) -> tuple[tuple[int, ...], int]:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return shape, math.prod(shape) * dtype.itemsize


def empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, starting on a 2 MiB boundary and on huge
    pages where available (see the module docstring)."""
    shape, nbytes = _shape_bytes(shape, dtype)
    if nbytes < _MIN_BYTES or _madvise() is None:
        return torch.empty(shape, dtype=dtype)
    return _fresh(nbytes).view(dtype).view(shape)


def _fresh(nbytes: int) -> torch.Tensor:
    """``nbytes`` (uint8) of a new private anonymous mapping, from a 2 MiB boundary, advised onto
    huge pages; unmapped when the last tensor viewing it goes. Not ``torch.empty``: malloc serves
    a large request from its heap where a freed region is big enough (a model's load leaves such
    regions behind), and heap pages already touched stay small whatever the advice: a worker's
    integer-path weights were found on 4 KiB pages that way."""
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"{nbytes} bytes could not be mapped: {e.strerror}") from e
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    offset = -raw.data_ptr() % HUGE_PAGE
    buf = raw[offset : offset + nbytes]
    advise_huge_pages(buf)
    return buf


class _Slabs:
    """Buffers carved out of slabs of ``SLAB`` bytes on huge pages, 64-byte aligned, in the
    order asked for. A slab lives as long as any buffer carved from it (they are views of it);
    the one being carved is also held here, so a process keeps at most one slab whose buffers
    are all gone."""

    SLAB = 16 * HUGE_PAGE
    ALIGN = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slab: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` uint8 of a slab (a buffer of half a slab or more: one of its own)."""
        if 2 * nbytes >= self.SLAB:
            return _fresh(nbytes)
        with self._lock:
            start = -(-self._used // self.ALIGN) * self.ALIGN
            if self._slab is None or start + nbytes > self._slab.numel():
                self._slab, start = _fresh(self.SLAB), 0
            self._used = start + nbytes
            return self._slab[start : start + nbytes]


_slabs = _Slabs()


def weights_empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` for a weight a step reads (and that lives as long as
    its model): on huge pages whatever its size, carved out of a shared slab (``_Slabs``), where
    the system has them; elsewhere a plain ``torch.empty``."""
    shape, nbytes = _shape_bytes(shape, dtype)
    if not nbytes or _madvise() is None:
        return torch.empty(shape, dtype=dtype)
    return _slabs.take(nbytes).view(dtype).view(shape)


def weights_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in ``weights_empty``'s memory."""
    out = weights_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def make_resident(t: torch.Tensor) -> None:
    """Map every page of CPU tensor ``t`` now, so that no later write to it faults: the kernel's
    ``MADV_POPULATE_WRITE`` (Linux 5.14+; the contents stay as they are), else by writing zeros.
    MemoryError when the memory is not there (better at start than under a request)."""
    madvise = _madvise()
    if madvise is not None:
        start = t.data_ptr() // PAGE * PAGE
        end = -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE) * PAGE
        if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.ENOMEM, errno.EFAULT):
            raise MemoryError(f"{end - start} bytes could not be made resident: {os.strerror(err)}")
    t.zero_()  # older kernels (EINVAL), other systems


def empty_pool(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    resident: bool = False,
) -> torch.Tensor:
    """An uninitialised KV pool: on the CPU on huge pages (``empty``), elsewhere ``torch.empty``;
    ``resident``: a CPU pool's memory mapped now (``make_resident``; device memory always is)."""
    if torch.device(device).type == "cpu":
        pool = empty(shape, dtype)
        if resident:
            make_resident(pool)
        return pool
    return torch.empty(tuple(shape), dtype=dtype, device=device)
