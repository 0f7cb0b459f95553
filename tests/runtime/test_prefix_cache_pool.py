"""Prefix caching in the BlockPool and the managers: hashes, sharing, LRU eviction, hits."""

import pytest
from kvskill.runtime import NULL_BLOCK_ID, BlockPool, KVCacheManager
from kvskill.runtime.prefix_hash import block_hashes, chain_hash, root_hash
from kvskill.runtime.request import Request, SamplingParams
from runtime_factories import Sink, attn_layer, full_and_sliding, mamba_layer, model_info


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), 0.0)


def test_hash_chains_parent_tokens_and_group():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [1, 2, 3, 4, 9, 6, 7, 8])
    ha = block_hashes(a, "FullAttention", 4, 2)
    hb = block_hashes(b, "FullAttention", 4, 2)
    assert ha[0] == hb[0] == chain_hash(root_hash("FullAttention"), [1, 2, 3, 4])
    # Block 1 has the same tokens 5..8 in neither: a differing earlier token changes it too.
    c = make_request("c", [0, 2, 3, 4, 5, 6, 7, 8])
    hc = block_hashes(c, "FullAttention", 4, 2)
    assert len({ha[1], hb[1], hc[1]}) == 3
    # Same tokens in another group: another hash.
    assert block_hashes(make_request("d", a.prompt_token_ids), "SlidingWindow", 4, 2) != ha
    # Kept on the request and extended, not recomputed.
    assert a.block_hashes["FullAttention"] is ha


def test_cached_block_stays_cached_while_free_and_is_evicted_lru_when_needed():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        assert pool.cache_block(b, bytes([i]))
    pool.free_blocks([blocks[1], blocks[0]])  # freed order: 2, then 1
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 4
    assert pool.get_cached_block(bytes([0])) == blocks[0]
    # A new block evicts the least recently freed cached block first.
    (new,) = pool.get_new_blocks(1)
    assert new == blocks[1]
    assert pool.get_cached_block(bytes([1])) is None and pool.block_hash[new] is None
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 3
    # touch takes a free cached block back out of the queue; a held one gains a holder.
    pool.touch([blocks[0], blocks[2]])
    assert pool.num_free_blocks == 0
    assert pool.ref_cnt[blocks[0]] == 1 and pool.ref_cnt[blocks[2]] == 2
    pool.free_blocks([blocks[2]])
    assert not pool.is_free(blocks[2])
    pool.free_blocks([blocks[2]])
    assert pool.is_free(blocks[2]) and pool.get_cached_block(bytes([2])) == blocks[2]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[2]])


def test_null_block_free_blocks_and_duplicate_content_are_never_cached():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="null block is never cached"):
        pool.cache_block(NULL_BLOCK_ID, b"x")
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")  # same content already cached in a
    assert not pool.cache_block(a, b"other")  # a block names one content
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="only held blocks"):
        pool.cache_block(b, b"z")
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 1 and pool.num_cached_blocks == 0


def _cache_all(mgr: KVCacheManager, request: Request) -> None:
    """Allocate the whole request, mark it computed and cache its full blocks."""
    assert mgr.allocate_slots(request.request_id, request.num_tokens, 0) is not None
    mgr.cache_blocks(request, request.num_tokens)


def test_full_attention_hit_is_the_cached_prefix_and_never_the_last_token():
    sink = Sink()
    mgr = KVCacheManager(
        model_info([attn_layer(sink, 0)]), num_blocks=20, enable_prefix_caching=True
    )
    first = make_request("a", list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    _cache_all(mgr, first)
    held = mgr.get_block_ids("a")["FullAttention"]
    same = make_request("b", list(range(10)) + [50, 51])
    hit, blocks = mgr.get_computed_blocks(same)
    assert hit == 8 and blocks == {"FullAttention": held[:2]}
    # A request whose tokens are all cached still computes its last token: 8 tokens = 2
    # full blocks, but the hit stops one block short.
    assert mgr.get_computed_blocks(make_request("c", list(range(8))))[0] == 4
    assert mgr.get_computed_blocks(make_request("d", [1] + list(range(1, 10))))[0] == 0
    # Taking the hit shares the blocks: counts 2, nothing new taken for them.
    free = mgr.num_free_blocks["FullAttention"]
    assert mgr.allocate_slots("b", 12, 8, computed_blocks=blocks) is not None
    assert mgr.get_block_ids("b")["FullAttention"][:2] == held[:2]
    assert mgr.num_free_blocks["FullAttention"] == free - 1
    assert [mgr.pools["FullAttention"].ref_cnt[b] for b in held[:2]] == [2, 2]


def test_freed_request_blocks_stay_cached_and_count_as_free():
    sink = Sink()
    mgr = KVCacheManager(
        model_info([attn_layer(sink, 0)]), num_blocks=6, enable_prefix_caching=True
    )
    first = make_request("a", list(range(12)))
    _cache_all(mgr, first)
    mgr.free("a")
    assert mgr.num_free_blocks == mgr.initial_free_blocks
    assert mgr.num_cached_blocks == 3
    again = make_request("a2", list(range(12)) + [7])
    hit, blocks = mgr.get_computed_blocks(again)
    assert hit == 12
    # The hit's free blocks count against the pool: 3 revived + 1 new of 5 free.
    assert mgr.can_allocate("a2", 13, 12, blocks)
    assert not mgr.can_allocate("a2", 13 + 8, 12, blocks)
    assert mgr.allocate_slots("a2", 13, 12, computed_blocks=blocks) is not None
    assert mgr.num_free_blocks["FullAttention"] == 1


def test_sliding_window_hit_needs_only_the_window_and_all_groups_agree():
    sink = Sink()
    # window 6, block size 4: a hit of L tokens needs blocks from (L - 5) // 4 on.
    mgr = KVCacheManager(
        full_and_sliding(sink, window=6), num_blocks=30, enable_prefix_caching=True
    )
    first = make_request("a", list(range(20)))
    _cache_all(mgr, first)
    full_ids = mgr.get_block_ids("a")["FullAttention"]
    sliding_ids = mgr.get_block_ids("a")["SlidingWindow"]
    mgr.free("a")
    # Evict the sliding group's blocks 0 and 1 (tokens 0..7): a hit of 16 tokens only needs
    # blocks 2 and 3 of the window group, so it still holds.
    pool = mgr.pools["SlidingWindow"]
    for b in sliding_ids[:2]:
        pool._evict(b)
    hit, blocks = mgr.get_computed_blocks(make_request("b", list(range(20)) + [3]))
    assert hit == 20
    assert blocks["FullAttention"] == full_ids[:5]
    assert blocks["SlidingWindow"] == [NULL_BLOCK_ID] * 3 + sliding_ids[3:5]
    # Evict the window group's block 3 as well: every L in 4..20 needs one of blocks 0, 1
    # or 3, so the window group accepts no hit, and the full group must agree on none.
    pool._evict(sliding_ids[3])
    assert mgr.get_computed_blocks(make_request("c", list(range(20)) + [3])) == (0, {})


def test_state_groups_turn_prefix_caching_off_with_a_reason():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)])
    mgr = KVCacheManager(info, num_blocks=10, enable_prefix_caching=True)
    assert not mgr.enable_prefix_caching
    assert "Mamba" in mgr.prefix_caching_disabled_reason
    assert "snapshot of the whole prefix" in mgr.prefix_caching_disabled_reason
    request = make_request("a", list(range(12)))
    _cache_all(mgr, request)
    assert mgr.num_cached_blocks == 0
    assert mgr.get_computed_blocks(make_request("b", list(range(12)) + [1])) == (0, {})
    # Not asked for: no reason to give.
    assert KVCacheManager(info, num_blocks=10).prefix_caching_disabled_reason is None
