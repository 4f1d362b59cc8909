"""Block allocator for the paged KV cache: pure Python, reference counts, prefix reuse.

A block is *free* when its reference count is 0. A free block that holds a full, hashed block of
tokens stays findable by its hash until it is handed out again, so a later prompt with the same
prefix can take it back without recomputing it (least recently freed blocks are reused first).

    block hash = H(parent block hash, the block's token ids)

so equal hashes mean equal token prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable across processes (the gateway routes by these hashes too)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Free blocks in the order they are handed out (oldest freed first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref count 1); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free):
            raise MemoryError(
                f"KV cache exhausted: asked for {num_blocks} blocks, {len(self._free)} of {self.num_blocks} free"
            )
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this hash, used or free, or None."""
        return self._block_of.get(block_hash)

    def take_cached(self, block_hash: bytes) -> int | None:
        """Take one more reference to the block cached under ``block_hash`` (None if not cached)."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1
        return block

    def register_hash(self, block: int, block_hash: bytes) -> None:
        """Mark a used, fully written block as holding ``block_hash`` (first writer wins)."""
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only a used block can be registered")
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 becomes free."""
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")
            if self._ref_counts[block] == 0:
                raise ValueError(f"block {block} freed twice")
        for block in reversed(blocks):  # tail blocks first: they are the least likely to be shared
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
