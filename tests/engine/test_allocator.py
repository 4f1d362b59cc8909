import pytest

from pdserve.kv_cache.allocator import BlockAllocator, hash_block, prefix_block_hashes


def test_allocate_and_free_all():
    a = BlockAllocator(8)
    blocks = a.allocate(5)
    assert len(set(blocks)) == 5 and a.num_free_blocks == 3 and a.num_used_blocks == 5
    a.free(blocks)
    assert a.num_free_blocks == 8


def test_exhaustion_refuses_and_corrupts_nothing():
    a = BlockAllocator(4)
    held = a.allocate(3)
    assert not a.can_allocate(2)
    with pytest.raises(MemoryError, match="asked for 2 blocks, 1 of 4 free"):
        a.allocate(2)
    assert a.num_free_blocks == 1 and all(a.ref_count(b) == 1 for b in held)
    a.free(held)
    assert a.num_free_blocks == 4


def test_double_free_and_bad_ids_are_errors():
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(ValueError, match="freed twice"):
        a.free([b])
    with pytest.raises(ValueError, match="out of range"):
        a.free([7])
    assert a.num_free_blocks == 4


def test_ref_counts_keep_shared_blocks_alive():
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    h = hash_block(None, [1, 2])
    a.register_hash(b, h)
    assert a.take_cached(h) == b and a.ref_count(b) == 2
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free_blocks == 3
    a.free([b])
    assert a.num_free_blocks == 4


def test_freed_block_stays_cached_until_reused():
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    h = hash_block(None, [1, 2])
    a.register_hash(b, h)
    a.free([b])
    assert a.lookup(h) == b
    assert a.take_cached(h) == b and a.num_free_blocks == 1  # revived from the free list
    a.free([b])
    # Handing every block out again overwrites the cached content: the hash must be forgotten.
    a.allocate(2)
    assert a.lookup(h) is None and a.take_cached(h) is None


def test_prefix_hashes_depend_on_the_whole_prefix():
    x = prefix_block_hashes([1, 2, 3, 4, 5], block_size=2)
    y = prefix_block_hashes([9, 2, 3, 4], block_size=2)
    assert len(x) == 2 and len(y) == 2
    assert x[1] != y[1]  # same second block, different parent
    assert prefix_block_hashes([1, 2, 3, 4, 7], block_size=2) == x


def test_hash_is_stable_across_processes():
    # blake2b of fixed bytes: a constant, unlike Python's salted hash().
    assert hash_block(None, [1, 2, 3]).hex() == hash_block(None, [1, 2, 3]).hex()
    assert len(hash_block(None, [1])) == 16
