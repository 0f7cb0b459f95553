"""The one block arithmetic: numbers worked by hand, and the core/kv_blocks contract."""

from __future__ import annotations

from kvskill.core.kv_blocks import (
    GroupBlockCost,
    reserved_pool_blocks,
    split_kv_budget,
    window_blocks_per_request,
)


def test_bounded_groups_are_paid_first_and_the_rest_is_shared():
    groups = [
        GroupBlockCost(key="FullAttention", bytes_per_block=40, max_blocks_per_request=None),
        GroupBlockCost(key="SlidingWindow", bytes_per_block=10, max_blocks_per_request=3),
        GroupBlockCost(key="Mamba", bytes_per_block=7, max_blocks_per_request=1),
    ]
    split = split_kv_budget(groups, budget_bytes=1_000, max_num_seqs=4)
    # window pool: 4 requests x 3 blocks + 1 null = 13 blocks x 10 B = 130 B
    # state pool:  4 requests x 1 row    + 1 null =  5 blocks x  7 B =  35 B
    # left: 1,000 - 130 - 35 = 835 B; full attention: 835 // 40 = 20 blocks (19 usable)
    assert split.num_blocks == {"FullAttention": 20, "SlidingWindow": 13, "Mamba": 5}
    assert split.reserved_bytes == 165 and split.shared_bytes == 835
    assert split.reserved_keys == ("SlidingWindow", "Mamba")
    assert split.growing_keys == ["FullAttention"]
    assert split.growing_bytes_per_block == 40 and split.fits


def test_growing_groups_share_one_block_count():
    groups = [
        GroupBlockCost(key="a", bytes_per_block=30, max_blocks_per_request=None),
        GroupBlockCost(key="b", bytes_per_block=20, max_blocks_per_request=None),
    ]
    # each token takes a slot in both: one block id costs 30 + 20 = 50 B; 1,000 // 50 = 20
    split = split_kv_budget(groups, budget_bytes=1_000, max_num_seqs=4)
    assert split.num_blocks == {"a": 20, "b": 20} and split.reserved_bytes == 0


def test_without_max_num_seqs_nothing_is_reserved():
    groups = [
        GroupBlockCost(key="FullAttention", bytes_per_block=40, max_blocks_per_request=None),
        GroupBlockCost(key="SlidingWindow", bytes_per_block=10, max_blocks_per_request=3),
    ]
    # both grow: 1,000 // (40 + 10) = 20 blocks each
    split = split_kv_budget(groups, budget_bytes=1_000, max_num_seqs=None)
    assert split.num_blocks == {"FullAttention": 20, "SlidingWindow": 20}


def test_a_budget_below_the_reserve_does_not_fit():
    groups = [
        GroupBlockCost(key="FullAttention", bytes_per_block=40, max_blocks_per_request=None),
        GroupBlockCost(key="Mamba", bytes_per_block=100, max_blocks_per_request=1),
    ]
    # the state pool alone is 128 x 1 + 1 = 129 blocks x 100 B = 12,900 B > 10,000 B
    split = split_kv_budget(groups, budget_bytes=10_000, max_num_seqs=128)
    assert not split.fits and split.shared_bytes == 10_000 - 12_900
    assert split.num_blocks == {"FullAttention": 0, "Mamba": 129}


def test_the_jamba_example_of_the_module_docstring():
    # 1 attention layer: 1 KV head x 32 dims x (K+V) x 2 B = 128 B per token, 128 per block;
    # 2 Mamba layers (d_inner 128, d_conv 4, d_state 4, bf16): conv 128 x 3 + SSM 128 x 4
    # = 896 elements x 2 B = 1,792 B per layer, 3,584 B per request
    groups = [
        GroupBlockCost(key="FullAttention", bytes_per_block=128 * 128, max_blocks_per_request=None),
        GroupBlockCost(key="Mamba", bytes_per_block=3_584, max_blocks_per_request=1),
    ]
    split = split_kv_budget(groups, budget_bytes=256 << 20, max_num_seqs=128)
    assert split.num_blocks["Mamba"] == 129 and split.reserved_bytes == 129 * 3_584 == 462_336
    assert split.num_blocks["FullAttention"] == (268_435_456 - 462_336) // 16_384 == 16_355


def test_window_bound_and_reserved_pool():
    # W 64 + a step of 2,048 tokens over 128-token blocks: ceil(2,111 / 128) + 1 = 18
    assert (
        window_blocks_per_request(sliding_window=64, block_size=128, max_num_batched_tokens=2048)
        == 18
    )
    # W 8 + 4 new tokens over 4-token blocks: ceil(11 / 4) + 1 = 4
    assert window_blocks_per_request(sliding_window=8, block_size=4, max_num_batched_tokens=4) == 4
    assert (
        window_blocks_per_request(sliding_window=None, block_size=4, max_num_batched_tokens=4)
        is None
    )
    assert reserved_pool_blocks(18, 128) == 128 * 18 + 1 == 2_305
