"""The Plan's state_cache: mixer kinds, per-state dtypes and bytes, the page size chosen."""

from __future__ import annotations

from kvskill.analyzer import analyze_model


def test_a_hybrid_lists_its_state_layers_states_and_the_page_that_holds_them():
    plan = analyze_model("nemotron_h")
    cache = plan.state_cache
    kinds = {layer.index: layer.attn_type for layer in plan.layers}
    assert [row["index"] for row in cache["layers"]] == [
        i for i, t in kinds.items() if t == "Mamba"
    ]
    assert {row["mixer"] for row in cache["layers"]} == {"mamba2"}
    conv, ssm = cache["states"]
    # each state in its own dtype: the SSM state pinned to float32 by the config
    assert (conv["dtype"], ssm["dtype"]) == ("bfloat16", "float32")
    heads, head_dim, d_state = ssm["shape"]
    assert ssm["bytes"] == heads * head_dim * d_state * 4
    assert conv["bytes"] == conv["shape"][0] * conv["shape"][1] * 2
    per_layer = cache["bytes_per_request_per_layer"]
    assert per_layer == conv["bytes"] + ssm["bytes"]  # conv bytes are a multiple of 4 here
    assert cache["bytes_per_request"] == per_layer * len(cache["layers"])
    page = cache["page"]
    # the attention block grows in blocks of 16 tokens until its page holds a state page
    block, per_token = page["attention_block_size"], page["attention_bytes_per_token"]
    assert block % 16 == 0 and block * per_token >= per_layer > (block - 16) * per_token
    assert page["page_size_bytes"] == block * per_token
    assert 0 <= page["state_padding_fraction"] < 16 * per_token / page["page_size_bytes"]


def test_state_groups_alone_page_one_state_and_other_models_have_no_state_cache():
    pure = analyze_model("mamba2").state_cache
    assert pure["page"]["attention_block_size"] is None
    assert pure["page"]["page_size_bytes"] == pure["bytes_per_request_per_layer"]
    assert analyze_model("qwen3_next").state_cache["layers"][0]["mixer"] == "gated_delta"
    assert analyze_model("qwen3").state_cache == {}


def test_only_a_state_the_config_pins_is_marked_pinned_and_unpinned_states_take_the_model_dtype():
    pinned = analyze_model("nemotron_h")
    assert [row["pinned"] for row in pinned.state_cache["states"]] == [False, True]
    assert pinned.pinned_state_dtypes() == {"ssm_state": "float32"}
    # the Plan's cache_entries and state_cache give each state the same dtype
    mamba = {e.cache_name: e.dtype for e in pinned.cache_entries["Mamba"]}
    assert mamba == {row["cache_name"]: row["dtype"] for row in pinned.state_cache["states"]}
    # a config without mamba_ssm_cache_dtype keeps the SSM state in the model's dtype, unpinned
    free = analyze_model("mamba2")
    conv, ssm = free.state_cache["states"]
    assert ssm["dtype"] == conv["dtype"] == "bfloat16"
    assert free.pinned_state_dtypes() == {} and not ssm["pinned"]
    # and one that sets it pins it, in the Plan's cache_entries and bytes alike
    fixed = analyze_model("mamba2", config_overrides={"mamba_ssm_cache_dtype": "torch.float32"})
    assert fixed.pinned_state_dtypes() == {"ssm_state": "float32"}
    assert [e.dtype for e in fixed.cache_entries["Mamba"]] == ["bfloat16", "float32"]
    assert fixed.state_cache["states"][1]["bytes"] == 2 * ssm["bytes"]
