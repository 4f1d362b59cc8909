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


def test_fresh_blocks_come_as_one_run_of_consecutive_ids():
    a = BlockAllocator(64)
    first, second = a.allocate(32), a.allocate(8)
    assert first == list(range(32)) and second == list(range(32, 40))
    a.free(first)
    # a hole of 32 at the start: the lowest run long enough
    assert a.allocate(20) == list(range(20))


def test_fragmented_free_blocks_come_as_the_longest_runs():
    a = BlockAllocator(16)
    held = a.allocate(16)
    a.free([held[i] for i in (1, 2, 5, 6, 7, 8, 12)])  # free runs: [1,2], [5..8], [12]
    got = a.allocate(6)
    assert got == [5, 6, 7, 8, 1, 2]  # the 4-run, then the 2-run: two pieces, not three
    assert a.num_free_blocks == 1 and a.allocate(1) == [12]


def test_blocks_holding_a_cached_prefix_are_handed_out_last():
    a = BlockAllocator(4)
    cached, plain = a.allocate(2), a.allocate(2)
    h = hash_block(None, [1, 2])
    a.register_hash(cached[0], h)
    a.free(cached)  # cached[0] keeps its prefix, cached[1] holds none
    a.free(plain)
    got = a.allocate(3)
    assert cached[0] not in got and a.lookup(h) == cached[0]
    assert a.allocate(1) == [cached[0]] and a.lookup(h) is None  # the last one: evicted


def test_retained_blocks_stay_in_use_until_freed_again():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.retain(blocks)
    a.free(blocks)  # the request ends; a KV transfer still reads them
    assert a.num_free_blocks == 2 and all(a.ref_count(b) == 1 for b in blocks)
    assert set(a.allocate(2)).isdisjoint(blocks)
    a.free(blocks)
    assert a.num_free_blocks == 2
    with pytest.raises(ValueError, match="not in use"):
        a.retain([blocks[0]])


def test_every_allocation_has_a_new_generation_and_free_blocks_have_none():
    a = BlockAllocator(4)
    first = a.allocate(2)
    gen = a.generation_of(first[0])
    assert gen > 0 and all(a.generation_of(b) == gen for b in first)
    assert a.generation_of(3) == 0  # free
    a.free(first)
    assert all(a.generation_of(b) == 0 for b in first)
    again = a.allocate(2)
    assert again == first and a.generation_of(again[0]) == a.generation > gen
