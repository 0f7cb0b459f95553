"""BlockPool: null block, free order, double-free and foreign-id rejection, usage."""

import pytest
from kvskill.runtime import NULL_BLOCK_ID, BlockPool


def test_null_block_is_never_handed_out_and_free_order_is_fifo():
    pool = BlockPool(5)
    # Four usable blocks; the null block 0 is reserved.
    assert pool.num_free_blocks == 4
    first = pool.get_new_blocks(4)
    assert first == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in first
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    # Freed blocks join the tail of the queue, oldest free first.
    pool.free_blocks([3, 1])
    pool.free_blocks([4])
    assert pool.get_new_blocks(3) == [3, 1, 4]


def test_double_free_foreign_id_and_null_are_handled():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError, match="double free of block"):
        pool.free_blocks([blocks[0]])
    with pytest.raises(ValueError, match="does not belong"):
        pool.free_blocks([4])
    # A null id (a slid-out block) in a free list is skipped, not an error.
    got = pool.get_new_blocks(1)
    pool.free_blocks([NULL_BLOCK_ID, got[0]])
    assert pool.num_free_blocks == 3


def test_failed_free_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.free_blocks([a, a])
    with pytest.raises(ValueError):
        pool.free_blocks([b, 99])
    assert pool.num_free_blocks == 1
    assert not pool.is_free(a) and not pool.is_free(b)


def test_seeded_order_is_a_shuffle_of_all_usable_blocks():
    pool = BlockPool(33, free_block_order_seed=7)
    order = pool.get_new_blocks(32)
    assert sorted(order) == list(range(1, 33))
    assert order != sorted(order)
    assert BlockPool(33, free_block_order_seed=7).get_new_blocks(32) == order


def test_usage_report_counts_used_blocks():
    pool = BlockPool(11)
    pool.get_new_blocks(5)
    usage = pool.usage()
    assert usage["num_used_blocks"] == 5
    assert usage["num_free_blocks"] == 5
    assert usage["usage"] == pytest.approx(0.5)


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)
