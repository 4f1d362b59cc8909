"""kernels.cpu.memory: huge-page backed CPU buffers."""

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
