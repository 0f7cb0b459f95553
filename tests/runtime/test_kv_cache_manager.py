"""KVCacheManager: grouping, all-or-nothing allocation, free, sizing, usage."""

from dataclasses import FrozenInstanceError

import pytest
import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime import KVCacheBlocks, KVCacheManager
from runtime_factories import Sink, attn_layer, full_and_sliding, mamba_layer, model_info


def test_groups_follow_attn_type_and_tensors_are_injected():
    sink = Sink()
    mgr = KVCacheManager(full_and_sliding(sink), num_blocks=12)
    assert mgr.group_keys == ["FullAttention", "SlidingWindow"]
    assert mgr.block_size_of("SlidingWindow") == 4
    mgr.allocate_cache_tensors()
    # init chain: every declared entry received [num_blocks, block_size, heads, dim].
    assert sorted(sink.tensors) == [(i, n) for i in range(3) for n in ("k_cache", "v_cache")]
    for tensor in sink.tensors.values():
        assert tensor.shape == (12, 4, 2, 8) and tensor.dtype == torch.float32


def test_allocation_is_all_or_nothing_across_groups():
    sink = Sink()
    # Full attention pool: 5 usable blocks; sliding pool: 5 usable blocks.
    mgr = KVCacheManager(full_and_sliding(sink, window=4), num_blocks=6)
    assert mgr.allocate_slots("a", 16) is not None  # 4 blocks in each group
    before = (mgr.get_block_ids("a"), mgr.num_free_blocks)
    # "b" needs 2 blocks per group; each pool has 1 left: nothing may change.
    assert not mgr.can_allocate("b", 8)
    assert mgr.allocate_slots("b", 8) is None
    assert (mgr.get_block_ids("a"), mgr.num_free_blocks) == before
    assert mgr.get_block_ids("b") == {"FullAttention": [], "SlidingWindow": []}
    mgr.free("a")
    assert mgr.num_free_blocks == mgr.initial_free_blocks
    assert mgr.allocate_slots("b", 8) is not None


def test_allocate_slots_names_the_new_blocks_or_returns_none():
    sink = Sink()
    # Block size 4, 5 usable blocks per group, fresh free queues hand out 1, 2, ...
    mgr = KVCacheManager(full_and_sliding(sink, window=4), num_blocks=6)
    # 5 tokens span two blocks in each group: the result names them, group by group.
    blocks = mgr.allocate_slots("a", 5)
    assert blocks == KVCacheBlocks({"FullAttention": (1, 2), "SlidingWindow": (1, 2)})
    assert blocks.num_new_blocks == 4
    assert {key: list(ids) for key, ids in blocks.new_block_ids.items()} == mgr.get_block_ids("a")
    with pytest.raises(FrozenInstanceError):
        blocks.new_block_ids = {}
    # Three more tokens fit in block 2: a success that adds nothing, and is not falsy.
    grown = mgr.allocate_slots("a", 8, num_computed_tokens=5)
    assert grown == KVCacheBlocks({"FullAttention": (), "SlidingWindow": ()})
    assert grown and grown.num_new_blocks == 0
    # "b" needs 4 blocks per group and 3 are left: None means "cannot now", nothing changed.
    assert mgr.allocate_slots("b", 16) is None
    assert mgr.get_block_ids("b") == {"FullAttention": [], "SlidingWindow": []}
    assert mgr.num_free_blocks == {"FullAttention": 3, "SlidingWindow": 3}


def test_window_release_frees_room_only_in_its_group():
    sink = Sink()
    mgr = KVCacheManager(full_and_sliding(sink, window=4), num_blocks=40)
    assert mgr.allocate_slots("a", 16) is not None
    for n in range(17, 33):
        assert mgr.allocate_slots("a", n) is not None
    ids = mgr.get_block_ids("a")
    assert len(ids["FullAttention"]) == len(ids["SlidingWindow"]) == 8
    assert 0 not in ids["FullAttention"]
    # 31 computed: the query at 31 needs keys 28..31, which is exactly logical block 7.
    assert ids["SlidingWindow"] == [0] * 7 + [ids["SlidingWindow"][7]]
    assert mgr.num_free_blocks == {"FullAttention": 31, "SlidingWindow": 38}


def test_explicit_num_computed_tokens_controls_the_release():
    sink = Sink()
    mgr = KVCacheManager(full_and_sliding(sink, window=4), num_blocks=40)
    mgr.allocate_slots("a", 12, num_computed_tokens=0)
    # Recompute from scratch (e.g. after preemption): nothing is released.
    mgr.allocate_slots("a", 12, num_computed_tokens=0)
    assert 0 not in mgr.get_block_ids("a")["SlidingWindow"]
    mgr.allocate_slots("a", 13, num_computed_tokens=12)
    assert mgr.get_block_ids("a")["SlidingWindow"][:2] == [0, 0]


def test_hybrid_pool_is_shared_by_every_group():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)], block_size=4)
    mgr = KVCacheManager(info, num_blocks=8, use_hybrid_blocks=True)
    assert mgr.allocate_slots("a", 9) is not None  # 3 attention blocks + 1 state block
    assert mgr.num_free_blocks == {"FullAttention": 3, "Mamba": 3}
    ids = mgr.get_block_ids("a")
    assert len(set(ids["FullAttention"]) | set(ids["Mamba"])) == 4
    # 4 free blocks would be enough for one group but not for both together.
    assert mgr.allocate_slots("b", 12) is None
    assert mgr.allocate_slots("b", 8) is not None


def test_calculate_block_num_contiguous_with_fixed_groups():
    sink = Sink()
    info = full_and_sliding(sink, window=8, block_size=4)
    # fp32, 2 heads x 8 dims x 4 tokens x (K+V) = 512 B per layer block.
    mgr = KVCacheManager(info, memory_budget_bytes=512 * 2 * 100)
    assert mgr.num_blocks == {"FullAttention": 66, "SlidingWindow": 66}
    bounded = KVCacheManager(
        info, memory_budget_bytes=512 * 2 * 100, max_num_seqs=4, max_num_batched_tokens=4
    )
    # Window 8 + 4 new tokens: ceil(11 / 4) + 1 = 4 blocks per request, 4 requests + null.
    assert bounded.num_blocks["SlidingWindow"] == 17
    assert bounded.num_blocks["FullAttention"] == (512 * 200 - 17 * 512) // 1024
    with pytest.raises(BadInputError, match="smaller than the fixed-block groups"):
        KVCacheManager(info, memory_budget_bytes=1000, max_num_seqs=4, max_num_batched_tokens=4)


def test_sizing_errors_are_bad_input():
    sink = Sink()
    with pytest.raises(BadInputError, match="num_blocks or memory_budget_bytes"):
        KVCacheManager(model_info([attn_layer(sink, 0)]))
    with pytest.raises(BadInputError, match="at least 2"):
        KVCacheManager(model_info([attn_layer(sink, 0)]), memory_budget_bytes=100)


def test_usage_report():
    sink = Sink()
    mgr = KVCacheManager(full_and_sliding(sink), num_blocks=12)
    mgr.allocate_cache_tensors()
    mgr.allocate_slots("a", 5)
    report = mgr.usage()
    assert report["layout"] == "contiguous"
    assert report["groups"]["FullAttention"]["num_layers"] == 2
    assert report["groups"]["FullAttention"]["pool"]["num_used_blocks"] == 2
    assert report["memory"]["total_bytes"] == 6 * 12 * 4 * 2 * 8 * 4


def test_token_and_state_groups_and_text_report():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)], block_size=4)
    mgr = KVCacheManager(info, num_blocks=8, use_hybrid_blocks=True)
    assert mgr.token_group_keys == ["FullAttention"]
    assert mgr.state_group_keys == ["Mamba"]
    mgr.allocate_cache_tensors()
    mgr.allocate_slots("a", 6)
    text = mgr.format_report()
    assert text.splitlines()[0] == "KV cache layout: page_pool"
    assert "FullAttention" in text and "blocks used 3/7" in text
    assert "mode=hybrid page=512 B" in text


def test_computed_beyond_total_is_rejected():
    sink = Sink()
    mgr = KVCacheManager(full_and_sliding(sink), num_blocks=12)
    with pytest.raises(ValueError, match="num_computed_tokens=9 exceeds num_tokens=8"):
        mgr.allocate_slots("a", 8, num_computed_tokens=9)


def test_step_tables_are_what_the_managers_hold():
    sink = Sink()
    layers = [
        attn_layer(sink, 0),
        attn_layer(sink, 1, "SlidingWindow", sliding_window=4),
        mamba_layer(sink, 2),
    ]
    # A shuffled free queue, so nothing below can rely on consecutive ids.
    mgr = KVCacheManager(model_info(layers, 4), num_blocks=40, free_block_order_seed=7)
    # a: 9 tokens cached and 2 new; b: a fresh 3-token prompt; c: 6 cached, decoding 1.
    requests = [("a", 9, 2), ("b", 0, 3), ("c", 6, 1)]
    for rid, cached, new in requests:
        if cached:
            assert mgr.allocate_slots(rid, cached, num_computed_tokens=0) is not None
        assert mgr.allocate_slots(rid, cached + new, num_computed_tokens=cached) is not None
    ids = [rid for rid, _, _ in requests]
    tables = mgr.step_tables(
        ids, starts=[c for _, c, _ in requests], num_new_tokens=[n for _, _, n in requests]
    )
    held = {rid: mgr.get_block_ids(rid) for rid in ids}
    assert list(tables.block_table) == ["FullAttention", "SlidingWindow", "Mamba"]
    for key in ("FullAttention", "SlidingWindow"):
        width = max(len(held[rid][key]) for rid in ids)
        rows = [held[rid][key] + [0] * (width - len(held[rid][key])) for rid in ids]
        assert tables.block_table[key].tolist() == rows
        assert tables.block_table[key].dtype == torch.int32
        # slot = block of the position * block size + offset, token by token
        expected = [
            held[rid][key][pos // 4] * 4 + pos % 4
            for rid, cached, new in requests
            for pos in range(cached, cached + new)
        ]
        assert tables.slot_mapping[key].tolist() == expected
    # The window released a's first block (null 0) and the table shows it as null.
    assert held["a"]["SlidingWindow"][0] == 0
    # The state group: one block per request, no token slots.
    assert "Mamba" not in tables.slot_mapping
    assert tables.block_table["Mamba"].tolist() == [held[rid]["Mamba"] for rid in ids]
    assert mgr.tracked_request_ids() == dict.fromkeys(tables.block_table, ids)
    for rid in ids:
        mgr.free(rid)
    assert mgr.tracked_request_ids() == dict.fromkeys(tables.block_table, [])


def test_max_tokens_per_request_counts_every_group_of_a_shared_pool():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)], block_size=4)
    # 7 usable pages shared: one goes to the request's state, 6 attention blocks = 24 tokens.
    mgr = KVCacheManager(info, num_blocks=8, use_hybrid_blocks=True)
    assert mgr.max_tokens_per_request(max_num_batched_tokens=16, enable_chunked_prefill=True) == 24
    # Separate pools: the attention pool alone bounds it, 7 blocks = 28 tokens.
    mgr = KVCacheManager(info, num_blocks=8)
    assert mgr.max_tokens_per_request(max_num_batched_tokens=16, enable_chunked_prefill=True) == 28
