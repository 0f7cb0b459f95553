"""Memory planning: per-token bytes, bounded sliding-window blocks, state per request."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.memory import parse_memory
from kvskill.analyzer.report import summary_rows
from kvskill.core.errors import BadInputError

SMALL_JAMBA = {
    "num_hidden_layers": 3,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "mamba_d_state": 4,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def test_sliding_layers_hold_a_bounded_number_of_blocks():
    budget = 16 << 30
    plan = analyze_model("gpt_oss", block_size=16, kv_memory_bytes=budget)
    memory = plan.memory
    per_layer = 2 * 8 * 64 * 2  # K+V, 8 KV heads x 64 dims, bf16
    assert memory["bytes_per_token"] == {
        "FullAttention": per_layer * 18,
        "SlidingWindow": per_layer * 18,
    }
    # window 128 with 16-token blocks: a decoding request's 128-token span touches 9 blocks
    assert memory["sliding_blocks_per_request"] == math.ceil(127 / 16) + 1 == 9
    assert memory["sliding_bytes_per_request"] == 9 * 16 * per_layer * 18
    # run reserves for a step of 2,048 new tokens: ceil((127 + 2048) / 16) + 1 = 137 blocks
    # per request, for its default 128 requests, plus the null block
    block_bytes = 16 * per_layer * 18
    window_pool = 128 * 137 + 1
    assert memory["reserved_groups"] == ["SlidingWindow"]
    assert memory["reserved_bytes"] == window_pool * block_bytes
    full_pool = (budget - window_pool * block_bytes) // block_bytes
    assert memory["num_blocks_by_group"] == {
        "FullAttention": full_pool,
        "SlidingWindow": window_pool,
    }
    assert memory["num_blocks"] == full_pool
    assert memory["max_tokens"] == (full_pool - 1) * 16
    # counting the sliding layers as growing would halve the tokens in flight
    assert memory["max_tokens_without_window_bound"] == budget // (per_layer * 36)


def test_a_budget_below_the_reserved_pools_is_reported_as_refused():
    # the same window pool needs 17,537 blocks x 576 KiB (about 9.6 GiB) before any token
    plan = analyze_model("gpt_oss", block_size=16, kv_memory_bytes=256 << 20)
    assert not plan.memory["budget_fits"] and plan.memory["max_tokens"] == 0
    assert any("smaller than the window and state pools" in w for w in plan.warnings)
    line = dict(summary_rows(plan))["memory"]
    assert "SlidingWindow 17,536 blocks + the null block (128 requests x 137 window blocks)" in line
    assert "run refuses it" in line


def test_report_line_names_what_the_budget_pays_first():
    plan = analyze_model("jamba", config_overrides=SMALL_JAMBA, kv_memory_bytes=256 << 20)
    line = dict(summary_rows(plan))["memory"]
    # 1 attention layer x 1 KV head x 32 dims x K+V x 2 B = 128 B/token, 16,384 B per block;
    # 2 Mamba layers x (conv 128 x 3 + SSM 128 x 4) x 2 B = 3,584 B per request
    assert plan.memory["state_bytes_per_request"] == 3_584
    mamba_pool = 128 * 1 + 1
    full_pool = ((256 << 20) - mamba_pool * 3_584) // 16_384
    assert plan.memory["num_blocks_by_group"] == {"FullAttention": full_pool, "Mamba": mamba_pool}
    # usable blocks, as run's "KV <group> blocks" lines count them, and the null block
    assert f"FullAttention {full_pool - 1:,} blocks + the null block, max tokens" in line
    assert "paid first: Mamba 128 blocks + the null block (128 requests x 1 state row)" in line
    assert "run's defaults max_num_seqs 128, max_num_batched_tokens 2048" in line
    assert "`kvskill run --dtype bfloat16` with this --kv-memory allocates these" in line


def test_window_only_model_is_bounded_by_requests_not_tokens():
    plan = analyze_model("mistral", block_size=128, kv_memory_bytes=8 << 30)
    memory = plan.memory
    assert memory["max_tokens"] is None
    per_request = memory["sliding_bytes_per_request"]
    assert per_request == 33 * 128 * (2 * 8 * 128 * 2 * 32)
    assert memory["max_requests_short"] == (8 << 30) // per_request


def test_hbm_budget_subtracts_an_estimate_of_the_weights():
    plan = analyze_model("qwen3", hbm_gb=80)
    memory = plan.memory
    cfg = plan.config
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    embed = cfg["vocab_size"] * hidden * (1 if cfg["tie_word_embeddings"] else 2)
    attn = 2 * hidden * 32 * 128 + 2 * hidden * 32 * 128  # q, o and k, v (MHA defaults)
    mlp = 3 * hidden * cfg["intermediate_size"]
    assert memory["weight_bytes_estimate"] == (embed + layers * (attn + mlp)) * 2
    assert memory["kv_memory_bytes"] == int(80 * (1 << 30) * 0.9) - memory["weight_bytes_estimate"]
    assert "hbm-gb" in memory["kv_memory_source"]


def test_no_budget_means_costs_only():
    memory = analyze_model("qwen3").memory
    assert "num_blocks" not in memory and memory["bytes_per_token"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_parse_memory_rejects_nonsense():
    with pytest.raises(BadInputError):
        parse_memory("eight gigs")


def test_weights_larger_than_the_device_leave_no_kv_memory():
    plan = analyze_model("deepseek_v3", hbm_gb=64)  # ~671B parameters cannot fit
    assert plan.memory["kv_memory_bytes"] == 0 and plan.memory["max_tokens"] == 0
    assert any("no memory left for the KV cache" in w for w in plan.warnings)


def test_compressed_entries_cost_their_rows_and_match_the_runtime_pools():
    """A compressed entry adds row / ratio bytes per token, and analyze's blocks per group are
    the pools the runtime builds for the same declarations (one group per manager_key)."""
    import torch
    from kvskill.analyzer.memory import plan_memory
    from kvskill.analyzer.plan import CacheEntryPlan
    from kvskill.runtime import CacheEntry, KVCacheManager, LayerCacheInfo, ModelCacheInfo

    block_size, budget, window = 16, 256 << 20, 8
    # (cache_name, attn_type, dim, compress_ratio, manager_key, layers declaring it)
    declared = [
        ("win_kv", "SlidingWindow", 64, 1, None, (0, 1, 2)),
        ("cmp_kv", "FullAttention", 64, 4, "c4", (0, 1)),
        ("idx_kv", "FullAttention", 32, 4, "c4", (0, 1)),
        ("cmp_kv", "FullAttention", 64, 16, "c16", (2,)),
    ]
    entries: dict[str, list[CacheEntryPlan]] = {}
    for name, attn_type, dim, ratio, key, layers in declared:
        entries.setdefault(attn_type, []).append(
            CacheEntryPlan(
                cache_name=name,
                dim=dim,
                num_head=1,
                dtype="bfloat16",
                sliding_window=window if attn_type == "SlidingWindow" else None,
                compress_ratio=ratio,
                manager_key=key,
                num_layers=len(layers),
            )
        )
    spec = SimpleNamespace(dtype="bfloat16", dtype_bytes=2, sliding_window=window)
    memory = plan_memory(
        spec=spec,
        config={},
        cache_entries=entries,
        layer_counts={"SlidingWindow": 3},
        block_size=block_size,
        kv_memory_bytes=budget,
        hbm_gb=None,
    )
    # 3 x 128 B window rows; 2 x (128 + 64) / 4 B; 128 / 16 B
    assert memory["bytes_per_token"] == {"SlidingWindow": 384, "FullAttention": 96 + 8}

    layers = []
    for index in range(3):
        caches = [
            CacheEntry(name, attn_type, dim, 1, torch.bfloat16, True, block_size=block_size,
                       manager_key=key, compress_ratio=ratio, tensor_setter=lambda t: None,
                       sliding_window=window if attn_type == "SlidingWindow" else None)
            for name, attn_type, dim, ratio, key, layer_ids in declared
            if index in layer_ids
        ]  # fmt: skip
        layers.append(LayerCacheInfo(index, caches))
    info = ModelCacheInfo(num_layers=3, layer_infos=layers)
    runtime = KVCacheManager(
        info, memory_budget_bytes=budget, max_num_seqs=128, max_num_batched_tokens=2048
    )
    assert runtime.num_blocks == memory["num_blocks_by_group"]
    assert set(runtime.num_blocks) == {"SlidingWindow", "c4", "c16"}
