"""KV pool tensors: per layer one K and one V pool ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import os

import torch

from pdserve import kernels
from pdserve.config import CacheConfig
from pdserve.model.config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens, in the KV cache's ``dtype`` (which may
    differ from the model's: ``CacheConfig.kv_cache_dtype``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def _device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"  # cgroup v2: this process's own, as a container sees it


def _number(path: str, key: str | None = None) -> int | None:
    """The number in a one-number file, or after ``key`` in a "key value" file (/proc/meminfo,
    a cgroup's memory.stat); None if there is none."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if key is None:
                    return int(parts[0])
                if parts and parts[0].rstrip(":") == key:
                    return int(parts[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes() -> int | None:
    """What this process may still take of the machine's memory: /proc/meminfo's MemAvailable,
    and below its cgroup's limit (v2: ``memory.max`` less what ``memory.current`` holds beyond
    reclaimable file cache); None if unknown."""
    known = []
    available_kb = _number(MEMINFO, "MemAvailable")
    if available_kb is not None:
        known.append(available_kb * 1024)
    limit, current = _number(f"{CGROUP}/memory.max"), _number(f"{CGROUP}/memory.current")
    if limit is not None and current is not None:  # "max" (no limit) reads as None
        known.append(limit - current + (_number(f"{CGROUP}/memory.stat", "inactive_file") or 0))
    return min(known) if known else None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def num_blocks_for(
    model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """Blocks of the KV cache's ``dtype`` that the budget holds."""
    budget = cache.kv_cache_bytes
    if budget is None:
        budget = int(_device_memory_bytes(device) * cache.kv_cache_memory_fraction)
    per_block = bytes_per_block(model, cache.block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block; one block of {cache.block_size} tokens "
            f"needs {per_block} bytes for this model"
        )
    return num_blocks


class KVCachePool:
    """Owns the KV memory of one worker; blocks are handed out by a ``BlockAllocator``. ``dtype``
    is the KV cache's (``EngineConfig.kv_torch_dtype``), not necessarily the model's."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        resident: bool = False,
    ) -> None:
        """``resident``: the memory mapped now (``empty_pool``), not as blocks are first written;
        ValueError when a CPU pool would not fit in the memory left (the kernel would kill the
        process while mapping it, with no word why)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        if resident and device.type == "cpu":
            nbytes = bytes_per_block(model, block_size, dtype) * num_blocks
            available = available_memory_bytes()
            if available is not None and nbytes > available:
                raise ValueError(
                    f"a KV cache of {_gib(nbytes)} does not fit in the {_gib(available)} of memory "
                    "left to this process: lower --kv-cache-bytes (or --lazy-kv-cache, to map it "
                    "only as it fills)"
                )

        # empty: a block's content is defined only once written (stale data is never read
        # because attention stops at each sequence's context length). CPU pools on huge pages.
        empty = kernels.get_backend(device).empty_pool
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (empty(shape, dtype, device, resident), empty(shape, dtype, device, resident))
            for _ in range(model.num_layers)
        ]
