"""--config-overrides on composite configs: each key set where the model reads it."""

from __future__ import annotations

import json

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.composite_overrides import ConfigLevels, raw_levels, route_overrides
from kvskill.cli import main
from kvskill.core.errors import BadInputError
from kvskill.implementer.writer import config_json
from kvskill.verify.shrink import shrink_config


@pytest.mark.parametrize("key", ["num_hidden_layers", "text_config.num_hidden_layers"])
def test_a_language_model_key_of_qwen3_5_changes_its_text_config(key):
    plan = analyze_model("qwen3_5", config_overrides={key: 4})
    # the text model's heads and its gated-delta layers stay: only the depth changes
    assert plan.num_layers == 4
    assert (plan.num_attention_heads, plan.num_key_value_heads, plan.head_dim) == (16, 4, 256)
    assert [layer.attn_type.value for layer in plan.layers] == ["Mamba"] * 3 + ["FullAttention"]
    assert not plan.implementer_blockers
    # config.json as apply writes it: the depth in text_config, none at the top level
    written = config_json(plan)
    assert written["text_config"]["num_hidden_layers"] == 4
    assert len(written["text_config"]["layer_types"]) == 4
    assert "num_hidden_layers" not in written
    # verify's shrunk twin keeps the overridden depth
    shrunk = shrink_config(plan.config).config
    assert shrunk["text_config"]["num_hidden_layers"] == 4


def test_a_per_layer_list_override_reaches_the_text_config():
    pattern = ["full_attention", "linear_attention"]
    plan = analyze_model(
        "qwen3_5", config_overrides={"num_hidden_layers": 2, "layer_types": pattern}
    )
    assert [layer.attn_type.value for layer in plan.layers] == ["FullAttention", "Mamba"]
    assert config_json(plan)["text_config"]["layer_types"] == pattern
    sources = {e.decision: e.source for e in plan.evidence}
    assert sources["layers"] == "--config-overrides text_config.layer_types"


def test_a_checkpoint_directory_keeps_its_own_layer_types(tmp_path):
    from transformers import CONFIG_MAPPING

    # a nested config.json as a checkpoint stores it: 32 layer_types in text_config
    config = CONFIG_MAPPING["qwen3_5"]().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match="override text_config.layer_types too"):
        analyze_model(str(tmp_path), config_overrides={"num_hidden_layers": 4})
    pattern = ["linear_attention", "full_attention"] * 2
    plan = analyze_model(
        str(tmp_path), config_overrides={"num_hidden_layers": 4, "layer_types": pattern}
    )
    assert [layer.attn_type.value for layer in plan.layers] == ["Mamba", "FullAttention"] * 2
    assert config_json(plan)["text_config"]["num_hidden_layers"] == 4
    assert (tmp_path / "config.json").read_text() == json.dumps(config)


def test_a_key_of_both_levels_is_set_at_both():
    plan = analyze_model("qwen3_5", config_overrides={"num_hidden_layers": 4, "dtype": "float32"})
    written = config_json(plan)
    assert written["dtype"] == written["text_config"]["dtype"] == "float32"
    assert {e.dtype for e in plan.cache_entries["FullAttention"]} == {"float32"}


def test_a_class_that_builds_text_config_from_the_top_level_is_overridden_there():
    # dots3_note builds text_config from top-level keys when it is given none
    plan = analyze_model("dots3_note", config_overrides={"num_hidden_layers": 4})
    assert plan.attention.value == "mla"
    assert plan.num_layers == 4
    assert plan.config["num_hidden_layers"] == plan.config["text_config"]["num_hidden_layers"]


def test_a_flat_config_takes_its_overrides_as_before():
    plan = analyze_model("llama", config_overrides={"num_hidden_layers": 2})
    assert plan.num_layers == 2
    assert plan.config["num_hidden_layers"] == 2
    assert "text_config" not in plan.config
    with pytest.raises(BadInputError, match="'text_config.num_hidden_layers' is not a key of"):
        analyze_model("llama", config_overrides={"text_config.num_hidden_layers": 2})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ("text_config.num_hidden_layer=4", "did you mean 'num_hidden_layers'"),
        ("vision_config.depth=1", "only text_config.KEY reaches into one"),
        ("text_config.rope_parameters.rope_theta=5", "reaches below a key of text_config"),
        ("num_hidden_layer=4", "of the 'qwen3_5' config or its text_config"),
    ],
)
def test_a_key_no_level_of_qwen3_5_has_exits_2_in_one_line(capsys, overrides, message):
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "qwen3_5", "--config-overrides", overrides])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def _levels(**changes) -> ConfigLevels:
    values = {
        "where": "the 'toy' config",
        "outer_stored": frozenset({"image_token_id", "dtype", "tie_word_embeddings"}),
        "outer_known": frozenset({"image_token_id", "dtype", "tie_word_embeddings"}),
        "text_stored": frozenset(
            {"num_hidden_layers", "layer_types", "dtype", "tie_word_embeddings"}
        ),
        "text_known": frozenset(
            {"num_hidden_layers", "layer_types", "dtype", "tie_word_embeddings", "head_dim"}
        ),
        "text_default": {"num_hidden_layers": 3, "layer_types": ["a", "b", "a"], "dtype": None},
    }
    return ConfigLevels(**{**values, **changes})


def test_routing_sets_each_key_at_its_level():
    routed = route_overrides(
        {"image_token_id": 1},
        {"num_hidden_layers": 2, "image_token_id": 7, "tie_word_embeddings": True, "head_dim": 8},
        _levels(),
    )
    # the default's three layer_types are stale for two layers: the class derives new ones
    assert routed.config == {
        "image_token_id": 7,
        "tie_word_embeddings": True,
        "text_config": {
            "num_hidden_layers": 2,
            "dtype": None,
            "tie_word_embeddings": True,
            "head_dim": 8,
        },
    }
    assert set(routed.paths) == {
        "image_token_id",
        "tie_word_embeddings",
        "text_config.num_hidden_layers",
        "text_config.tie_word_embeddings",
        "text_config.head_dim",
    }


def test_routing_keeps_a_given_text_config_and_its_lists():
    base = {"text_config": {"num_hidden_layers": 3, "layer_types": ["a", "b", "a"]}}
    routed = route_overrides(base, {"text_config.num_hidden_layers": 2}, _levels())
    # a list the user's config gives is theirs: the config class names a mismatch
    assert routed.config["text_config"] == {"num_hidden_layers": 2, "layer_types": ["a", "b", "a"]}
    assert base["text_config"]["num_hidden_layers"] == 3


def test_routing_a_flat_composite_keeps_every_key_at_the_top():
    routed = route_overrides(
        {"num_hidden_layers": 3},
        {"text_config.num_hidden_layers": 2, "image_token_id": 7},
        _levels(flat=True),
    )
    assert routed.config == {"num_hidden_layers": 2, "image_token_id": 7}


def test_a_remote_config_json_routes_by_its_own_keys():
    raw = {"model_type": "vendor_vl", "image_token_id": 5, "text_config": {"n_layer": 8}}
    levels = raw_levels(raw, {"rotary_base"}, "the config in config.json")
    routed = route_overrides(raw, {"n_layer": 2, "rotary_base": 10, "image_token_id": 6}, levels)
    assert routed.config["text_config"] == {"n_layer": 2, "rotary_base": 10}
    assert routed.config["image_token_id"] == 6
    assert raw_levels({"n_layer": 8}, set(), "x") is None
