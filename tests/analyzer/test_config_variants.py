"""Config variants: qwen2-style window switches and attention tensor parallelism."""

from __future__ import annotations

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import WindowTokens
from kvskill.core.errors import BadInputError
from kvskill.core.overrides import parse_overrides

FULL, SLIDING = "FullAttention", "SlidingWindow"


def test_qwen2_sliding_window_off_means_full_attention_everywhere():
    plan = analyze_model(
        "qwen2",
        config_overrides={"num_hidden_layers": 4, "use_sliding_window": False,
                          "sliding_window": 64, "max_window_layers": 2},
    )  # fmt: skip
    assert plan.attn_types == [FULL]
    assert plan.window_tokens == {}


def test_qwen2_sliding_window_on_slides_the_layers_from_max_window_layers():
    plan = analyze_model(
        "qwen2",
        config_overrides={"num_hidden_layers": 4, "use_sliding_window": True,
                          "sliding_window": 64, "max_window_layers": 2},
    )  # fmt: skip
    # transformers' Qwen2Config: layer i slides when i >= max_window_layers
    assert plan.layer_attn_types() == [FULL, FULL, SLIDING, SLIDING]
    assert [layer.sliding_window for layer in plan.layers] == [None, None, 64, 64]
    assert plan.window_tokens == {SLIDING: WindowTokens(pre_tokens=63, next_tokens=0)}
    assert plan.mixed_attn_types
    layer_sources = [e.source for e in plan.evidence if e.decision == "layers"]
    assert any("layer_types" in s for s in layer_sources)


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
@pytest.mark.parametrize(("model_type", "kv_heads"), [("mistral", 8), ("qwen3_moe", 4)])
def test_kv_heads_per_rank_follow_attn_tp_size(model_type, kv_heads, tp):
    plan = analyze_model(model_type, attn_tp_size=tp)
    expected = max(kv_heads // tp, 1)
    assert plan.num_key_value_heads_per_rank == expected
    assert plan.attn_tp_size == tp
    for entries in plan.cache_entries.values():
        assert {entry.num_head for entry in entries} == {expected}
    per_layer = 2 * expected * plan.head_dim * 2
    assert plan.kv_bytes_per_token == per_layer * len(plan.layers)
    replicated = [w for w in plan.warnings if "replicated" in w]
    assert bool(replicated) == (tp > kv_heads)


def test_overrides_parse_json_values_and_lists():
    parsed = parse_overrides(
        'num_hidden_layers=4,layer_types=["full_attention","sliding_attention"],'
        "sliding_window=null,name=abc,ratio=0.5"
    )
    assert parsed == {
        "num_hidden_layers": 4,
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": None,
        "name": "abc",
        "ratio": 0.5,
    }
    with pytest.raises(BadInputError):
        parse_overrides("num_hidden_layers")


def test_invalid_overrides_are_bad_input():
    with pytest.raises(BadInputError, match="num_hidden_layers must be an integer"):
        analyze_model("qwen3", config_overrides={"num_hidden_layers": "four"})
    with pytest.raises(BadInputError, match="not a multiple of num_key_value_heads 3"):
        analyze_model("qwen3", config_overrides={"num_key_value_heads": 3})
