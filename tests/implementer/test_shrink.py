"""The verify shrink keeps the structure: every per-layer list, grouped routing."""

from __future__ import annotations

from kvskill.implementer.shrink import MIN_LAYERS, VOCAB_SIZE, shrink_config


def test_every_per_layer_list_is_cut_with_the_layers_and_keeps_each_kind():
    # Attention kinds repeat early, MLP kinds only change at layer 3: the kept layers must
    # reach it, and every per-layer list must be as long as the new num_hidden_layers.
    config = {
        "num_hidden_layers": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 5,
        "no_rope_layers": [1, 1, 1, 1, 0, 1, 1, 1],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "vocab_size": 1000,
    }
    new = shrink_config(config).config
    layers = new["num_hidden_layers"]
    assert layers == 5  # the first 0 of no_rope_layers is layer 4
    for key in ("layer_types", "mlp_layer_types", "no_rope_layers"):
        assert new[key] == config[key][:layers]
        assert set(new[key]) == set(config[key])


def test_lists_that_are_not_per_layer_are_left_alone():
    config = {"num_hidden_layers": 3, "eos_token_id": [1, 2, 3], "layer_norm_eps": 1e-5}
    new = shrink_config(config).config
    assert new["num_hidden_layers"] == max(MIN_LAYERS, 2)
    assert new["eos_token_id"] == [1, 2, 3]


def test_grouped_routing_becomes_one_group():
    # DeepSeek-V3-style routers view the experts as n_group groups; with the shrunk expert
    # count the original 8 groups would not divide it.
    config = {
        "num_hidden_layers": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
    }
    new = shrink_config(config).config
    assert (new["n_group"], new["topk_group"]) == (1, 1)
    assert new["num_experts"] > new["num_experts_per_tok"]


def test_per_layer_head_counts_follow_the_model_wide_count_down():
    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "num_attention_heads_per_layer": [48, 48, 48],
    }
    new = shrink_config(config).config
    layers = new["num_hidden_layers"]
    assert new["num_attention_heads_per_layer"] == [new["num_attention_heads"]] * layers


def test_token_ids_past_the_shrunk_vocabulary_stay_ints_inside_it():
    # Some config classes (cwm) require an int bos/eos id: None would not build.
    config = {"num_hidden_layers": 2, "bos_token_id": 100_000, "eos_token_id": [3, 128_001]}
    new = shrink_config(config).config
    assert isinstance(new["bos_token_id"], int) and 0 <= new["bos_token_id"] < VOCAB_SIZE
    assert new["eos_token_id"][0] == 3 and 0 <= new["eos_token_id"][1] < VOCAB_SIZE
    assert "pad_token_id" not in new  # keys the config did not have are not added


def test_a_window_no_layer_uses_can_be_kept():
    # verify keeps a window the plan does not use: transformers may still build the original's
    # cache from it (moshi), so shrinking it would change the original.
    config = {"num_hidden_layers": 2, "sliding_window": 3000, "max_position_embeddings": 3000}
    assert shrink_config(config).config["sliding_window"] == 8
    assert shrink_config(config, shrink_window=False).config["sliding_window"] == 3000


def test_a_composite_towers_per_layer_lists_and_text_facing_widths_follow_the_shrink():
    config = {
        "model_type": "vlm",
        "text_config": {
            "num_hidden_layers": 4,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 32000,
        },
        "vision_config": {
            "num_hidden_layers": 3,
            "layer_types": ["full", "window", "full"],
            "image_mean": [0.5, 0.5, 0.5],
            "hidden_size": 1024,
            # the merger projects into the text model: its width must follow the text's
            "out_hidden_size": 2048,
        },
    }
    shrunk = shrink_config(config).config
    vision = shrunk["vision_config"]
    assert vision["num_hidden_layers"] == 1
    assert vision["layer_types"] == ["full"]
    assert vision["image_mean"] == [0.5, 0.5, 0.5]  # keyed by channel, not by layer
    assert vision["hidden_size"] == 1024
    assert vision["out_hidden_size"] == shrunk["text_config"]["hidden_size"] != 2048
