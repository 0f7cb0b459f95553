"""Memory planning: per-token bytes, bounded sliding-window blocks, state per request."""

from __future__ import annotations

import math

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.memory import parse_memory
from kvskill.core.errors import BadInputError


def test_sliding_layers_hold_a_bounded_number_of_blocks():
    budget = 256 << 20
    plan = analyze_model("gpt_oss", block_size=16, kv_memory_bytes=budget)
    memory = plan.memory
    per_layer = 2 * 8 * 64 * 2  # K+V, 8 KV heads x 64 dims, bf16
    assert memory["bytes_per_token"] == {
        "FullAttention": per_layer * 18,
        "SlidingWindow": per_layer * 18,
    }
    # window 128 with 16-token blocks: a 128-token span touches at most 9 blocks
    assert memory["sliding_blocks_per_request"] == math.ceil(127 / 16) + 1 == 9
    fixed = 9 * 16 * per_layer * 18
    assert memory["sliding_bytes_per_request"] == fixed
    assert memory["max_tokens"] == (budget - fixed) // (per_layer * 18)
    # counting the sliding layers as growing would halve the tokens in flight
    assert memory["max_tokens_without_window_bound"] == budget // (per_layer * 36)
    assert memory["max_tokens"] > memory["max_tokens_without_window_bound"]


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
