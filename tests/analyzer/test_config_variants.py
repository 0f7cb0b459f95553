"""Config variants: qwen2-style window switches and attention tensor parallelism."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.config import normalise
from kvskill.analyzer.plan import WindowTokens
from kvskill.core.errors import BadInputError
from kvskill.core.overrides import parse_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from vendor_fixtures import VENDOR_ROOT  # noqa: E402

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


def test_an_override_key_the_config_does_not_have_is_bad_input_naming_the_close_key(tmp_path):
    """A config class keeps unknown keywords as attributes nothing reads: a misspelt key must
    not pass as an override that changed nothing."""
    with pytest.raises(BadInputError, match="did you mean 'num_hidden_layers'"):
        analyze_model("qwen3", config_overrides={"num_hidden_layer": 4})
    with pytest.raises(BadInputError, match="'no_such_setting' is not a key"):
        analyze_model("qwen3", config_overrides={"no_such_setting": 1})
    # keys the class maps or takes are overrides like any other
    assert len(analyze_model("qwen3", config_overrides={"num_hidden_layers": 3}).layers) == 3


def test_torch_dtype_is_the_dtype_transformers_stores_and_wins_over_config_json(tmp_path):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["qwen3"](num_hidden_layers=2, dtype="float32")
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    assert any(stored.get(key) == "float32" for key in ("dtype", "torch_dtype"))
    full = analyze_model(str(tmp_path))
    for spelling in ("torch_dtype", "dtype"):
        half = analyze_model(str(tmp_path), config_overrides={spelling: "bfloat16"})
        assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token, spelling
    with pytest.raises(BadInputError, match="both dtype and torch_dtype"):
        analyze_model(
            str(tmp_path), config_overrides={"dtype": "float16", "torch_dtype": "float16"}
        )


def test_remote_code_overrides_are_checked_against_the_directorys_own_keys(tmp_path):
    shutil.copytree(VENDOR_ROOT / "query_groups_bhsd", tmp_path / "m")
    model = str(tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text(encoding="utf-8"))
    depth_key = "num_layers" if "num_layers" in raw else "num_hidden_layers"
    assert len(analyze_model(model, config_overrides={depth_key: 1}).layers) == 1
    with pytest.raises(BadInputError, match=f"did you mean '{depth_key}'"):
        analyze_model(model, config_overrides={depth_key + "s": 1})


# -- vendor key names ------------------------------------------------------------------------

#: ChatGLM3-6B's shape: its own names for depth, vocabulary, MLP, head width and positions,
#: and KV groups that count only under multi_query_attention
CHATGLM_STYLE = {
    "model_type": "chatglm",
    "num_layers": 28,
    "padded_vocab_size": 65024,
    "hidden_size": 4096,
    "ffn_hidden_size": 13696,
    "kv_channels": 128,
    "num_attention_heads": 32,
    "seq_length": 8192,
    "layernorm_epsilon": 1e-5,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
}
#: Qwen-7B's shape: per-head width in kv_channels, positions in seq_length, no KV head key
QWEN7B_STYLE = {
    "model_type": "qwen",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "kv_channels": 128,
    "intermediate_size": 22016,
    "vocab_size": 151936,
    "seq_length": 8192,
    "layer_norm_epsilon": 1e-6,
    "rotary_pct": 1.0,
}
#: InternLM2's and Baichuan2's shapes: transformers' own names (InternLM2 with grouped KV)
INTERNLM2_STYLE = {
    "model_type": "internlm2",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 92544,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
}
#: GPT-2 / bloom style: short names that the config class's attribute_map points at
GPT2_STYLE = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}
GPT2_MAP = {
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "max_position_embeddings": "n_positions",
}


@pytest.mark.parametrize(
    ("config", "attribute_map", "expected", "keys"),
    [
        (
            CHATGLM_STYLE,
            {},
            (28, 4096, 32, 2, 128, 65024, 13696, 8192),
            {"num_layers": "num_layers", "num_kv_heads": "multi_query_group_num",
             "head_dim": "kv_channels", "vocab_size": "padded_vocab_size",
             "intermediate_size": "ffn_hidden_size", "max_positions": "seq_length"},
        ),
        (
            QWEN7B_STYLE,
            {},
            (32, 4096, 32, 32, 128, 151936, 22016, 8192),
            {"head_dim": "kv_channels", "max_positions": "seq_length"},
        ),
        (
            INTERNLM2_STYLE,
            {},
            (32, 4096, 32, 8, 128, 92544, 14336, 32768),
            {"num_kv_heads": "num_key_value_heads", "max_positions": "max_position_embeddings"},
        ),
        (
            GPT2_STYLE,
            GPT2_MAP,
            (12, 768, 12, 12, 64, 0, 0, 1024),
            {"num_layers": "n_layer", "num_heads": "n_head", "hidden_size": "n_embd",
             "max_positions": "n_positions"},
        ),
    ],
    ids=["chatglm3", "qwen-7b", "internlm2", "gpt2"],
)  # fmt: skip
def test_vendor_key_names_give_the_same_spec(config, attribute_map, expected, keys):
    spec = normalise(config, attribute_map=attribute_map)
    got = (
        spec.num_layers,
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.vocab_size,
        spec.intermediate_size,
        spec.max_positions,
    )
    assert got == expected
    for field, key in keys.items():
        assert spec.sources[field] == key


def test_chatglm_groups_count_only_under_multi_query_attention():
    spec = normalise({**CHATGLM_STYLE, "multi_query_attention": False})
    assert (spec.num_heads, spec.num_kv_heads) == (32, 32)
    assert spec.sources["num_kv_heads"] == "multi_query_attention"


def test_falcon_multi_query_is_one_kv_head_unless_the_new_architecture_counts_them():
    falcon = {"num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8,
              "num_kv_heads": 8, "multi_query": True}  # fmt: skip
    assert normalise(falcon).num_kv_heads == 1
    assert normalise({**falcon, "new_decoder_architecture": True}).num_kv_heads == 8
    assert normalise({**falcon, "multi_query": False}).num_kv_heads == 8


def test_the_config_classs_attribute_map_wins_over_a_name_it_does_not_read():
    # A class mapping num_attention_heads to its own key reads that key: an unrelated
    # num_heads (a Mamba mixer's, say) is not the attention's.
    config = {"num_hidden_layers": 2, "hidden_size": 256, "n_q": 4, "num_heads": 16}
    spec = normalise(config, attribute_map={"num_attention_heads": "n_q"})
    assert (spec.num_heads, spec.head_dim, spec.sources["num_heads"]) == (4, 64, "n_q")


def _chatglm_dir(tmp_path, **config):
    from tests.analyzer.fixtures import write_remote_model

    vendor = {k: None for k in ("num_hidden_layers", "num_key_value_heads", "vocab_size",
                                "intermediate_size", "hidden_size", "num_attention_heads")}  # fmt: skip
    small = {**CHATGLM_STYLE, "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
             "kv_channels": 64, "ffn_hidden_size": 128, "padded_vocab_size": 512}  # fmt: skip
    return write_remote_model(tmp_path / "glm", **{**vendor, **small, **config})


def test_a_vendor_config_is_analysed_with_evidence_naming_each_vendor_key(tmp_path):
    plan = analyze_model(str(_chatglm_dir(tmp_path)))
    assert (plan.num_layers, plan.num_attention_heads, plan.num_key_value_heads) == (2, 4, 2)
    assert (plan.head_dim, plan.attention) == (64, "gqa")
    assert {e.num_head for e in plan.cache_entries["FullAttention"]} == {2}
    config_lines = {e.source: e.reason for e in plan.evidence if e.decision == "config"}
    assert "read from `num_layers`" in config_lines["config.json:num_layers"]
    assert "read from `kv_channels`" in config_lines["config.json:kv_channels"]
    groups = config_lines["config.json:multi_query_group_num"]
    assert "num_key_value_heads = 2" in groups and "multi_query_attention=true" in groups
    assert "config.json:num_attention_heads" not in config_lines  # a standard name: no line


def test_a_remote_config_classs_attribute_map_is_read_without_running_it(tmp_path):
    from tests.analyzer.fixtures import write_remote_model

    root = write_remote_model(
        tmp_path / "m", num_hidden_layers=None, num_attention_heads=None, n_blocks=3, n_q=4
    )
    (root / "configuration_tiny.py").write_text(
        'import pathlib\npathlib.Path(__file__).with_name("SIDE_EFFECT_CONFIG").write_text("x")\n'
        "\n\nclass TinyConfig:\n"
        '    model_type = "tiny_remote"\n'
        '    attribute_map = {"num_hidden_layers": "n_blocks", "num_attention_heads": "n_q"}\n',
        encoding="utf-8",
    )
    plan = analyze_model(str(root))
    assert (plan.num_layers, plan.num_attention_heads, plan.head_dim) == (3, 4, 16)
    reasons = [e.reason for e in plan.evidence if e.decision == "config"]
    assert any("attribute_map: num_attention_heads -> n_q" in r for r in reasons)
    assert not (root / "SIDE_EFFECT_CONFIG").exists()


def test_gpt2_evidence_names_the_keys_its_attribute_map_points_at():
    plan = analyze_model("gpt2")
    sources = {e.source for e in plan.evidence if e.decision == "config"}
    assert {"gpt2 default config:n_head", "gpt2 default config:n_layer"} <= sources
