"""Block pool: ref counts, LRU eviction of cached blocks, never a block handed out twice."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.kv.block_pool import BlockPool, OutOfBlocksError


def test_allocate_hands_out_lowest_free_ids_first_and_counts_free():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.num_free == 1
    assert pool.usage_ratio == 0.75


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_freed_cached_blocks_are_reused_by_hash_until_evicted_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([b, a])  # b freed first: it is the least recently used
    assert pool.lookup(111) is a and pool.lookup(222) is b
    (fresh,) = pool.allocate(1)
    assert fresh is b  # LRU eviction
    assert pool.lookup(222) is None and pool.lookup(111) is a
    pool.touch([a])  # a prefix hit takes a free cached block back
    assert a.ref_count == 1 and pool.num_free == 0
    pool.free([c])
    assert pool.num_free == 1


def test_shared_block_returns_to_free_list_only_after_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, 7)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 2


def test_double_free_is_detected():
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=40))
def test_random_allocate_free_sequences_never_hand_out_a_held_block(ops):
    pool = BlockPool(8)
    held = []
    for allocate, count in ops:
        if allocate and count <= pool.num_free:
            new = pool.allocate(count)
            ids = {b.block_id for b in held}
            assert not ids & {b.block_id for b in new}
            held.extend(new)
        elif held:
            pool.free(held[:count])
            del held[:count]
    assert pool.num_free == 8 - len(held)
