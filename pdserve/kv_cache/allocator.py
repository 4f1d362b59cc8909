"""Block allocator for the paged KV cache: pure Python, reference counts, prefix reuse.

A block is *free* when its reference count is 0. A free block that holds a full, hashed block of
tokens stays findable by its hash until it is handed out again, so a later prompt with the same
prefix can take it back without recomputing it.

Which free blocks are handed out: first those that hold no cached prefix, as runs of consecutive
ids (the lowest run long enough, else the longest runs), then cached ones, least recently freed
first. Consecutive ids are consecutive memory in the KV pools, so a request's blocks in few runs
are copied and sent as few pieces (the KV transfer sends each run straight from pool to pool).

    block hash = H(parent block hash, the block's token ids)

so equal hashes mean equal token prefixes, not just equal blocks.

Generations: every ``allocate`` call draws a new number from a counter that only grows and stamps
it on the blocks it hands out (``generation_of``; 0: free). The decode worker uses its
reservation's generation as the id of the KV transfer into those blocks, so a message of an
earlier owner of a block can never pass for one of the current owner's (transfer/fence.py).
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


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: bytes | None = None
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none), chained on
    from ``parent`` (the hash of the block before them; None: they start the sequence)."""
    hashes: list[bytes] = []
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
        # Free blocks without a cached prefix: 1 at their id (runs are found by bytearray.find).
        self._plain = bytearray(b"\x01" * num_blocks)
        self._num_plain = num_blocks
        # Free blocks holding a cached prefix, in the order they are handed out (oldest freed first).
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.generation = 0  # of the latest allocate(); never goes down
        self._generation_of = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_plain + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref count 1); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self.num_free_blocks:
            raise MemoryError(
                f"KV cache exhausted: asked for {num_blocks} blocks, {self.num_free_blocks} of "
                f"{self.num_blocks} free"
            )
        blocks = self._take_plain(min(num_blocks, self._num_plain))
        while len(blocks) < num_blocks:
            block, _ = self._cached.popitem(last=False)
            self._forget_hash(block)
            blocks.append(block)
        self.generation += 1
        for block in blocks:
            self._ref_counts[block] = 1
            self._generation_of[block] = self.generation
        return blocks

    def generation_of(self, block: int) -> int:
        """The generation of the ``allocate`` that handed ``block`` to its owner; 0 if free."""
        return self._generation_of[block] if self._ref_counts[block] else 0

    def _take_plain(self, n: int) -> list[int]:
        """``n`` free blocks without a cached prefix: the lowest run of n, else the longest runs."""
        if n == 0:
            return []
        plain = self._plain
        start = plain.find(b"\x01" * n)
        if start >= 0:
            runs = [(start, n)]
        else:
            found = []
            pos = plain.find(1)
            while pos >= 0:
                end = plain.find(0, pos)
                end = len(plain) if end < 0 else end
                found.append((end - pos, pos))
                pos = plain.find(1, end)
            found.sort(key=lambda run: (-run[0], run[1]))
            runs, left = [], n
            for length, pos in found:
                runs.append((pos, min(length, left)))
                left -= min(length, left)
                if not left:
                    break
        blocks = []
        for pos, length in runs:
            plain[pos : pos + length] = bytes(length)
            blocks.extend(range(pos, pos + length))
        self._num_plain -= n
        return blocks

    def cached_hashes(self) -> tuple[bytes, ...]:
        """Every block hash cached now (used or free): one C-level copy, safe to take from
        another thread while the engine runs."""
        return tuple(self._block_of)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this hash, used or free, or None."""
        return self._block_of.get(block_hash)

    def take_cached(self, block_hash: bytes) -> int | None:
        """Take one more reference to the block cached under ``block_hash`` (None if not cached)."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._cached[block]
        self._ref_counts[block] += 1
        return block

    def retain(self, blocks: Sequence[int]) -> None:
        """Take one more reference to each of ``blocks`` (used ones): they stay allocated until
        freed once more, e.g. while a KV transfer still reads them."""
        for block in blocks:
            if not 0 <= block < self.num_blocks or self._ref_counts[block] == 0:
                raise ValueError(f"block {block} is not in use; only a used block can be retained")
        for block in blocks:
            self._ref_counts[block] += 1

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
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._plain[block] = 1
                    self._num_plain += 1

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
