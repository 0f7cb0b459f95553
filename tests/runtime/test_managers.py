"""Single-type managers: growth, window release with null placeholders, Mamba, registration."""

import pytest
from kvskill.runtime import (
    ATTN_TYPE_MANAGER_MAP,
    FIXED_BLOCK_ATTN_TYPES,
    BlockPool,
    CacheInfoError,
    FullAttentionManager,
    KVCacheManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    register_attn_type,
)
from runtime_factories import Sink, attn_layer, model_info


def test_full_attention_grows_one_block_per_block_size_tokens():
    mgr = FullAttentionManager(BlockPool(10), group_key="FullAttention", block_size=4)
    # 5 tokens span 2 blocks; growing to 8 needs none; 9 needs a third.
    assert mgr.allocate_new_blocks("r", 5) == [1, 2]
    assert mgr.allocate_new_blocks("r", 8) == []
    assert mgr.allocate_new_blocks("r", 9) == [3]
    assert mgr.get_block_ids("r") == [1, 2, 3]
    mgr.free("r")
    assert mgr.block_pool.num_free_blocks == 9


def test_sliding_window_releases_blocks_wholly_outside_the_window():
    pool = BlockPool(20)
    mgr = SlidingWindowManager(pool, group_key="SlidingWindow", block_size=2, sliding_window=4)
    # Prefill 7 tokens: 4 blocks, all needed while the prompt itself is computed.
    mgr.allocate_new_blocks("r", 7)
    assert mgr.get_block_ids("r") == [1, 2, 3, 4]
    # 7 computed: the query at position 7 needs keys 4..7; tokens 0..3 (blocks 0, 1) go.
    assert mgr.get_num_skipped_tokens(7) == 4
    mgr.remove_skipped_blocks("r", 7)
    mgr.allocate_new_blocks("r", 8)
    assert mgr.get_block_ids("r") == [0, 0, 3, 4]
    assert pool.num_free_blocks == 17
    # Keep decoding: logical indices stay, the live count stays bounded.
    for n in range(9, 60):
        mgr.remove_skipped_blocks("r", n - 1)
        mgr.allocate_new_blocks("r", n)
        assert mgr.num_live_blocks("r") <= -(-4 // 2) + 1
        assert len(mgr.get_block_ids("r")) == -(-n // 2)


def test_sliding_window_net_allocation_counts_released_blocks():
    mgr = SlidingWindowManager(BlockPool(20), group_key="S", block_size=2, sliding_window=2)
    mgr.allocate_new_blocks("r", 6)
    # With 6 computed the next query (position 6) needs key 5 and itself: blocks 0, 1 free up
    # and 2 more are needed for 6..9, so the pool loses nothing net.
    assert mgr.get_num_blocks_to_allocate("r", 10, 6) == 0


def test_mamba_holds_one_block_per_request():
    mgr = MambaManager(BlockPool(4), group_key="Mamba", block_size=1)
    assert mgr.get_num_blocks_to_allocate("a", 1000, 0) == 1
    mgr.allocate_new_blocks("a", 1000)
    mgr.allocate_new_blocks("a", 5000)
    assert mgr.get_block_ids("a") == [1]
    assert (
        MambaManager.max_blocks_per_request(
            block_size=1, sliding_window=None, max_num_batched_tokens=None
        )
        == 1
    )


def test_registering_a_new_attn_type_makes_it_valid():
    class ChunkedManager(SingleTypeKVCacheManager):
        """Keeps only the current 8-token chunk visible."""

        attn_type = "Chunked"

        def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
            return num_computed_tokens // 8 * 8

    sink = Sink()
    # Unknown before registration: the error names the layer, the entry and the fix.
    with pytest.raises(CacheInfoError, match="cache 'k_cache' in layer 0 has unknown attn_type"):
        KVCacheManager(model_info([attn_layer(sink, 0, "Chunked")]), num_blocks=10)
    register_attn_type("Chunked", ChunkedManager, fixed_block=True)
    try:
        info = model_info([attn_layer(sink, 0, "Chunked"), attn_layer(sink, 1)], block_size=4)
        assert info.layer_infos[0].caches[0].group_key == "Chunked"
        assert "Chunked" in FIXED_BLOCK_ATTN_TYPES
        # The new type gets its own group, pool and release rule inside KVCacheManager.
        mgr = KVCacheManager(info, num_blocks=10)
        assert mgr.group_keys == ["Chunked", "FullAttention"]
        assert mgr.allocate_slots("r", 17) is not None
        assert mgr.allocate_slots("r", 18) is not None
        # 17 computed: the current chunk starts at 16, so blocks 0-3 are released.
        assert mgr.get_block_ids("r")["Chunked"][:4] == [0, 0, 0, 0]
        assert mgr.num_free_blocks == {"Chunked": 8, "FullAttention": 4}
    finally:
        ATTN_TYPE_MANAGER_MAP.pop("Chunked")
        FIXED_BLOCK_ATTN_TYPES.discard("Chunked")
    with pytest.raises(TypeError):
        register_attn_type("Bad", dict)


def test_builtin_map_and_fixed_types():
    assert ATTN_TYPE_MANAGER_MAP["FullAttention"] is FullAttentionManager
    assert ATTN_TYPE_MANAGER_MAP["SlidingWindow"] is SlidingWindowManager
    assert ATTN_TYPE_MANAGER_MAP["Mamba"] is MambaManager
    assert {"SlidingWindow", "Mamba"} <= FIXED_BLOCK_ATTN_TYPES
    assert "FullAttention" not in FIXED_BLOCK_ATTN_TYPES
