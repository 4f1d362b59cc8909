"""What a worker's prefix cache holds, in a few KiB: a Bloom filter of its cached block hashes.

A worker sends one with each heartbeat (``WorkerStats.prefix_summary``); a gateway asks it how
many leading blocks of a prompt are cached there (``hit_blocks``), and routes by that.

The block hashes are chained (``allocator.hash_block``: a block's hash covers every token before
it), so a prompt's cached prefix is the leading run of its block hashes that the filter holds.
Size: about 10 bits per cached block (4 probes: about 1 % false positives), rounded up to a power
of two, between 256 bytes and MAX_BYTES. Above MAX_BYTES * 8 / 10 = 13,107 cached blocks the
false positives grow (at 32,768 blocks about 14 %); a false positive makes the gateway expect a
hit that is not there, which costs one misrouted prefill, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_BYTES = 256
MAX_BYTES = 16 << 10
NUM_PROBES = 4
BITS_PER_HASH = 10


def _positions(block_hash: bytes, num_bits: int, num_probes: int) -> list[int]:
    """The hash is already uniform (blake2b): its 4-byte words are the probes."""
    mask = num_bits - 1
    return [
        int.from_bytes(block_hash[4 * i : 4 * i + 4], "little") & mask for i in range(num_probes)
    ]


@dataclass(frozen=True)
class PrefixSummary:
    block_size: int
    num_hashes: int
    bloom: bytes
    num_probes: int = NUM_PROBES

    def __post_init__(self) -> None:
        n = len(self.bloom)
        if n and (n & (n - 1) or n > MAX_BYTES):
            raise ValueError(
                f"a prefix summary's filter must be a power of two of at most {MAX_BYTES} bytes, "
                f"got {n}"
            )
        if not 1 <= self.num_probes <= 4:
            raise ValueError(f"num_probes must be 1 to 4, got {self.num_probes}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @classmethod
    def build(cls, block_size: int, hashes: Iterable[bytes]) -> PrefixSummary:
        hashes = list(hashes)
        if not hashes:
            return cls(block_size, 0, b"")
        num_bytes = MIN_BYTES
        while num_bytes < MAX_BYTES and num_bytes * 8 < BITS_PER_HASH * len(hashes):
            num_bytes *= 2
        bits = bytearray(num_bytes)
        num_bits = num_bytes * 8
        for h in hashes:
            for p in _positions(h, num_bits, NUM_PROBES):
                bits[p >> 3] |= 1 << (p & 7)
        return cls(block_size, len(hashes), bytes(bits))

    def __contains__(self, block_hash: bytes) -> bool:
        if not self.bloom:
            return False
        bits = self.bloom
        return all(
            bits[p >> 3] >> (p & 7) & 1
            for p in _positions(block_hash, len(bits) * 8, self.num_probes)
        )

    def hit_blocks(self, prompt_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its ``prefix_block_hashes``) are cached."""
        n = 0
        for h in prompt_hashes:
            if h not in self:
                break
            n += 1
        return n
