"""The verify shrink keeps the structure: every per-layer list, grouped routing."""

from __future__ import annotations

from kvskill.verify.shrink import INTERMEDIATE_SIZE, MIN_LAYERS, VOCAB_SIZE, shrink_config


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


# -- vendor key names: the shrink writes the keys the model reads ------------------------------

CHATGLM_STYLE = {
    "model_type": "chatglm",
    "num_layers": 28,
    "padded_vocab_size": 65024,
    "hidden_size": 4096,
    "ffn_hidden_size": 13696,
    "kv_channels": 128,
    "num_attention_heads": 32,
    "seq_length": 8192,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
}


def test_chatglm_style_config_shrinks_through_its_own_keys():
    new = shrink_config(CHATGLM_STYLE).config
    assert new["num_layers"] == MIN_LAYERS
    assert new["padded_vocab_size"] == VOCAB_SIZE
    assert new["ffn_hidden_size"] == INTERMEDIATE_SIZE
    assert new["kv_channels"] * new["num_attention_heads"] == new["hidden_size"]
    # grouped KV stays grouped: fewer groups than heads, more than one
    assert 1 < new["multi_query_group_num"] < new["num_attention_heads"]
    assert new["seq_length"] == 8192  # positions are not a size to shrink
    # no standard key the model would ignore next to its own
    assert not {"num_hidden_layers", "vocab_size", "head_dim", "num_key_value_heads"} & set(new)


def test_chatglm_groups_are_left_alone_without_multi_query_attention():
    new = shrink_config({**CHATGLM_STYLE, "multi_query_attention": False}).config
    assert new["multi_query_group_num"] == 2  # unread by the model: MHA
    assert "num_key_value_heads" not in new


def test_qwen7b_style_head_width_follows_the_heads():
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "kv_channels": 128, "intermediate_size": 22016, "vocab_size": 151936,
              "seq_length": 8192, "rotary_pct": 1.0}  # fmt: skip
    new = shrink_config(config).config
    # Qwen-7B's projections are kv_channels * heads wide and must equal hidden_size
    assert new["kv_channels"] * new["num_attention_heads"] == new["hidden_size"] < 4096
    assert "head_dim" not in new


def test_falcon_multi_query_gets_no_kv_count():
    config = {"num_hidden_layers": 4, "hidden_size": 4544, "num_attention_heads": 71,
              "num_kv_heads": 71, "multi_query": True, "ffn_hidden_size": 18176}  # fmt: skip
    new = shrink_config(config).config
    assert new["num_kv_heads"] == 71 and "num_key_value_heads" not in new  # the flag decides
    assert new["ffn_hidden_size"] == INTERMEDIATE_SIZE


def test_gptj_partial_rotation_stays_partial():
    config = {"n_layer": 4, "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "vocab_size": 50400}
    new = shrink_config(config).config
    head = new["n_embd"] // new["n_head"]
    assert 0 < new["rotary_dim"] < head and new["rotary_dim"] % 2 == 0
    assert new["rotary_dim"] * 4 == head  # the same quarter of a head


def test_gpt2_config_class_builds_the_shrunk_sizes_from_its_own_keys():
    # Through the class's attribute_map: transformers' GPT2Config keeps n_layer / n_head /
    # n_embd, and a standard key beside them would be a second, conflicting value.
    from kvskill.analyzer.config_keys import class_attribute_map
    from transformers import GPT2Config

    config = GPT2Config().to_dict()
    new = shrink_config(config, attribute_map=class_attribute_map("gpt2")).config
    assert not {"num_hidden_layers", "num_attention_heads", "hidden_size"} & set(new)
    built = GPT2Config(**{k: v for k, v in new.items() if k != "model_type"})
    assert (built.n_layer, built.n_head, built.n_embd) == (MIN_LAYERS, 4, 256)
    assert (built.num_hidden_layers, built.num_attention_heads) == (MIN_LAYERS, 4)


def test_a_vendor_attribute_map_points_the_shrink_at_its_keys():
    config = {"n_blocks": 12, "n_q": 16, "width": 2048, "vocab_size": 1000}
    names = {"num_hidden_layers": "n_blocks", "num_attention_heads": "n_q",
             "hidden_size": "width"}  # fmt: skip
    new = shrink_config(config, attribute_map=names).config
    assert (new["n_blocks"], new["n_q"], new["width"]) == (MIN_LAYERS, 4, 256)
    assert not {"num_hidden_layers", "num_attention_heads", "hidden_size"} & set(new)


def test_falcon_h1_mixer_width_follows_the_shrunk_heads():
    config = {"model_type": "falcon_h1", "num_hidden_layers": 32, "hidden_size": 4096,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": 8,
              "mamba_d_state": 256, "mamba_n_groups": 1, "mamba_expand": 2,
              "mamba_chunk_size": 256, "vocab_size": 128000}  # fmt: skip
    new = shrink_config(config).config
    # FalconH1Config checks mamba_d_ssm == heads x head_dim; the MLP width is not the mixer's
    assert new["mamba_d_ssm"] == new["mamba_n_heads"] * new["mamba_d_head"] < 1024
    assert new["mamba_d_ssm"] == new["mamba_expand"] * new["hidden_size"]
    # without mamba_d_ssm (mamba2, bamba) nothing adds it
    del config["mamba_d_ssm"]
    assert "mamba_d_ssm" not in shrink_config(config).config


def test_head_dim_is_written_only_where_the_config_holds_the_key():
    base = {"num_hidden_layers": 8, "hidden_size": 4544, "num_attention_heads": 71}
    # falcon: no head_dim key (a read-only property of its config class, hidden / heads)
    derived = shrink_config(base).config
    assert "head_dim" not in derived
    assert derived["hidden_size"] // derived["num_attention_heads"] == 64
    # hunyuan: the key is present as None and the model reads it
    assert shrink_config({**base, "head_dim": None}).config["head_dim"] == 64
