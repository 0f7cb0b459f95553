"""Decision tables: each family's expected KV design, written from its known architecture."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import CacheEntryPlan, SparseModes, WindowTokens

FULL, SLIDING, MAMBA = "FullAttention", "SlidingWindow", "Mamba"


def sources_of(plan, decision: str) -> list[str]:
    return [e.source for e in plan.evidence if e.decision == decision]


def test_llama_is_plain_mha_full_attention():
    plan = analyze_model("llama")
    # Llama-2-7B defaults: 32 layers, 32 heads, 32 KV heads, head_dim 128
    assert plan.attention == "mha"
    assert plan.kv_mode == "paged" and plan.legacy_reason is None
    assert plan.attn_types == [FULL] and not plan.mixed_attn_types
    assert len(plan.layers) == 32 and all(layer.sliding_window is None for layer in plan.layers)
    assert plan.fa_version == "v1" and "sink" in plan.fa_version_reason
    assert plan.input_layout == "TND" and plan.mla_absorb is False
    assert plan.sparse_mode == {FULL: SparseModes(prefill=3, decode=3)}
    assert plan.window_tokens == {}
    assert plan.softmax_scale == pytest.approx(128**-0.5)
    assert plan.cache_entries[FULL] == [
        CacheEntryPlan(cache_name="k_cache", dim=128, num_head=32, dtype="bfloat16",
         sliding_window=None),
        CacheEntryPlan(cache_name="v_cache", dim=128, num_head=32, dtype="bfloat16",
         sliding_window=None),
    ]  # fmt: skip
    # K and V, 32 heads x 128 dims x 2 bytes, 32 layers
    assert plan.kv_bytes_per_token == 2 * 32 * 128 * 2 * 32
    assert plan.is_mla_backend is False


@pytest.mark.parametrize(
    ("model_type", "heads", "kv_heads", "head_dim", "layers"),
    [
        ("qwen3", 32, 32, 128, 32),
        ("qwen2", 32, 32, 128, 32),
        ("qwen3_moe", 32, 4, 64, 24),
        ("mixtral", 32, 8, 128, 32),
    ],
)
def test_standard_families_are_full_attention(model_type, heads, kv_heads, head_dim, layers):
    plan = analyze_model(model_type)
    assert plan.attention == ("mha" if heads == kv_heads else "gqa")
    assert plan.attn_types == [FULL]
    assert (plan.num_attention_heads, plan.num_key_value_heads) == (heads, kv_heads)
    assert plan.head_dim == head_dim and len(plan.layers) == layers
    assert plan.sparse_mode == {FULL: SparseModes(prefill=3, decode=3)}
    assert plan.fa_version == "v1" and plan.input_layout == "TND"
    assert plan.softmax_scale == pytest.approx(head_dim**-0.5)
    assert plan.kv_bytes_per_token == 2 * kv_heads * head_dim * 2 * layers


def test_code_facts_point_at_the_seam_lines():
    plan = analyze_model("qwen3")
    code = plan.code
    assert code["attention_classes"] == ["Qwen3Attention"]
    assert code["decoder_layer_class"] == "Qwen3DecoderLayer"
    assert code["model_class"] == "Qwen3Model"
    assert code["causal_lm_class"] == "Qwen3ForCausalLM"
    assert plan.architecture == "Qwen3ForCausalLM"
    assert code["cache_api"] == "transformers5"
    lines = Path(plan.source.modeling_file).read_text(encoding="utf-8").splitlines()
    assert "cache.update(" in lines[code["cache_update_line"] - 1]
    assert "attention_interface(" in lines[code["attention_interface_line"] - 1]
    assert lines[code["causal_lm_line"] - 1].startswith("class Qwen3ForCausalLM")
    attn = code["attention"]["Qwen3Attention"]
    assert "self.scaling" in lines[attn["scaling_line"] - 1]
    assert lines[attn["forward_line"] - 1].strip().startswith("def forward")
    assert plan.source.kind == "transformers"
    assert plan.source.modeling_file.endswith("models/qwen3/modeling_qwen3.py")
    assert plan.config["model_type"] == "qwen3" and plan.config["num_hidden_layers"] == 32
    assert f"modeling_qwen3.py:{attn['scaling_line']}" in sources_of(plan, "softmax_scale")


def test_mistral_window_applies_to_every_layer():
    plan = analyze_model("mistral")
    assert plan.attn_types == [SLIDING]
    assert {layer.sliding_window for layer in plan.layers} == {4096}
    assert plan.sparse_mode == {SLIDING: SparseModes(prefill=4, decode=4)}
    # the window W=4096 includes the current token; pre_tokens=P admits P+1 keys
    assert plan.window_tokens == {SLIDING: WindowTokens(pre_tokens=4095, next_tokens=0)}
    assert plan.cache_entries[SLIDING][0].sliding_window == 4096
    assert any("masking_utils.py:" in s for s in sources_of(plan, "sparse_mode.SlidingWindow"))


def test_gpt_oss_mixes_sliding_and_full_and_needs_fa_v2_for_sinks():
    plan = analyze_model("gpt_oss")
    # 36 layers alternating sliding (even) / full (odd), window 128, 64 heads / 8 KV, dim 64
    assert plan.attn_types == [FULL, SLIDING] and plan.mixed_attn_types
    kinds = plan.layer_attn_types()
    assert kinds[:4] == [SLIDING, FULL, SLIDING, FULL] and len(kinds) == 36
    assert plan.has_sinks and plan.fa_version == "v2"
    assert "learnable_sink" in plan.fa_version_reason
    fa_sources = sources_of(plan, "fa_version")
    assert fa_sources and fa_sources[0].startswith("modeling_gpt_oss.py:")
    assert plan.sparse_mode == {
        FULL: SparseModes(prefill=3, decode=3),
        SLIDING: SparseModes(prefill=4, decode=4),
    }
    assert plan.window_tokens == {SLIDING: WindowTokens(pre_tokens=127, next_tokens=0)}
    assert plan.num_key_value_heads_per_rank == 8
    assert plan.softmax_scale == pytest.approx(0.125)
    assert plan.kv_bytes_per_token == 2 * 8 * 64 * 2 * 36
    assert any("mixed attn_types" in w for w in plan.warnings)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def test_deepseek_v3_is_mla_absorb():
    plan = analyze_model("deepseek_v3", attn_tp_size=8)
    assert plan.attention == "mla" and plan.mla_absorb and plan.is_mla_backend
    assert plan.input_layout == "TND_NTD"
    assert plan.sparse_mode == {FULL: SparseModes(prefill=3, decode=0)}
    # latent KV is a single head on every rank, whatever the attention TP size
    assert plan.num_key_value_heads_per_rank == 1
    assert plan.cache_entries[FULL] == [
        CacheEntryPlan(cache_name="nope_cache", dim=512, num_head=1, dtype="bfloat16",
         sliding_window=None),
        CacheEntryPlan(cache_name="rope_cache", dim=64, num_head=1, dtype="bfloat16",
         sliding_window=None),
    ]  # fmt: skip
    assert plan.mla.qk_rope_head_dim == 64
    assert plan.kv_bytes_per_token == (512 + 64) * 2 * 61
    # no YaRN in the default config: scale over qk_nope + qk_rope = 192 dims
    assert plan.softmax_scale == pytest.approx(192**-0.5)
    assert not plan.implementer_blockers


def test_deepseek_v3_yarn_scale_includes_mscale_squared():
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    plan = analyze_model("deepseek_v3", config_overrides={"rope_parameters": rope})
    expected = 192**-0.5 * _yarn_mscale(40.0, 1.0) ** 2
    assert plan.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert any("--config-overrides" in s for s in sources_of(plan, "softmax_scale"))
    assert any("mscale^2" in w for w in plan.warnings)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_mla_scale_matches_the_installed_attention_module(model_type):
    """Cross-check with transformers' own attention module at toy size."""
    import importlib

    from transformers import CONFIG_MAPPING

    module_name = f"transformers.models.{model_type}.modeling_{model_type}"
    attention_class = {"deepseek_v3": "DeepseekV3Attention", "deepseek_v2": "DeepseekV2Attention"}
    attention = getattr(importlib.import_module(module_name), attention_class[model_type])
    overrides = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 16,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64,
        "v_head_dim": 16,
        "num_hidden_layers": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 256,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    }
    plan = analyze_model(model_type, config_overrides=overrides)
    module = attention(CONFIG_MAPPING[model_type](**overrides), layer_idx=0)
    assert plan.softmax_scale == pytest.approx(module.scaling, rel=1e-12)
    assert plan.softmax_scale != pytest.approx((16 + 64) ** -0.5)
    # kv_lora_rank 32 is not a size the fused MLA path takes: warned, not refused
    assert any("kv_lora_rank is 32" in b for b in plan.implementer_blockers)


def test_a_scale_written_over_the_head_dim_is_evaluated_from_the_code():
    """zamba2 scales by (head_dim / 2)^-0.5: the Plan carries the module's own value."""
    from transformers.models.zamba2 import configuration_zamba2, modeling_zamba2

    plan = analyze_model("zamba2")
    config = configuration_zamba2.Zamba2Config()
    module = modeling_zamba2.Zamba2Attention(config, layer_idx=0, num_fwd_mem_blocks=1, block_id=0)
    assert plan.softmax_scale == pytest.approx(module.scaling, rel=1e-12)
    assert plan.softmax_scale == pytest.approx((config.attention_head_dim / 2) ** -0.5)
    assert any("/ 2" in e.reason for e in plan.evidence if e.decision == "softmax_scale")


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("self.head_dim**-0.5", 64**-0.5),
        ("(self.head_dim / 2) ** -0.5", 32**-0.5),
        ("1 / math.sqrt(self.head_dim)", 1 / 8),
        ("config.attention_multiplier", None),
        ("self.head_dim ** -0.5 * self.mult", None),
        ("lambda: 1", None),
    ],
)
def test_scale_of_expression(expr, expected):
    from kvskill.analyzer.scale import scale_of_expression

    value = scale_of_expression(expr, 64)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_deepseek_v2_is_mla_too():
    plan = analyze_model("deepseek_v2")
    assert plan.attention == "mla" and plan.input_layout == "TND_NTD"
    assert plan.sparse_mode[FULL] == SparseModes(prefill=3, decode=0)
    assert plan.cache_entries[FULL][0].dim == 512


def test_qwen3_next_linear_attention_layers_become_mamba_state_entries():
    plan = analyze_model("qwen3_next")
    # 48 layers: three gated-delta-net layers, then one full attention layer
    kinds = plan.layer_attn_types()
    assert kinds[:4] == [MAMBA, MAMBA, MAMBA, FULL]
    assert kinds.count(FULL) == 12 and kinds.count(MAMBA) == 36
    assert plan.attn_types == [FULL, MAMBA] and plan.mixed_attn_types
    assert {layer.kind for layer in plan.layers if layer.attn_type == MAMBA} == {"linear_attention"}
    assert plan.sparse_mode == {FULL: SparseModes(prefill=3, decode=3)}
    conv, ssm = plan.cache_entries[MAMBA]
    # conv over q, k (16 heads x 128 each) and v (32 heads x 128), kernel 4 keeps 3 columns
    assert conv.cache_name == "conv_state" and conv.dim == [3, 2 * 16 * 128 + 32 * 128]
    assert ssm.cache_name == "ssm_state" and ssm.num_head == 32
    assert ssm.dim == [128, 128]
    # transformers keeps the recurrent state in float32 in a bfloat16 model; the conv state
    # in the model's dtype. Per layer: 3 x 8192 bf16 + 32 x 128 x 128 fp32, 36 layers.
    assert (conv.dtype, ssm.dtype) == ("bfloat16", "float32")
    assert plan.memory["state_bytes_per_request"] == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert plan.code["linear_attention_classes"] == ["Qwen3NextGatedDeltaNet"]
    # only the 12 full-attention layers grow with tokens (2 KV heads x 256 dims)
    assert plan.kv_bytes_per_token == 2 * 2 * 256 * 2 * 12
    assert plan.memory["state_bytes_per_request"] > 0
    assert any(e.decision == "cache_entries.Mamba" for e in plan.evidence)


def test_kimi_linear_delta_layers_get_states_from_the_linear_head_keys():
    plan = analyze_model("kimi_linear")
    assert plan.attention == "mla" and MAMBA in plan.attn_types
    conv, ssm = plan.cache_entries[MAMBA]
    # q, k and v convolved together: 3 x 32 heads x 128; kernel 4 keeps 3 columns
    assert conv.dim == [3, 3 * 32 * 128] and conv.dtype == "bfloat16"
    assert (ssm.num_head, ssm.dim, ssm.dtype) == (32, [128, 128], "float32")
    assert plan.implementer_blockers == []


def test_mimo_sliding_layers_double_their_kv_heads_in_the_entries_and_memory():
    # MiMo-V2-Flash's attention __init__: num_key_value_heads = config... * 2 if is_swa
    plan = analyze_model("mimo_v2_flash")
    full, sliding = plan.cache_entries[FULL], plan.cache_entries[SLIDING]
    assert [e.num_head for e in full] == [4, 4]
    assert [e.num_head for e in sliding] == [8, 8]
    per_layer = (192 + 128) * 2  # k + v dims x bf16 bytes
    layers = plan.layer_attn_types().count(SLIDING)
    assert plan.memory["bytes_per_token"][SLIDING] == 8 * per_layer * layers
    (cited,) = sources_of(plan, "cache_entries.SlidingWindow")
    assert cited.startswith("modeling_mimo_v2_flash.py:")
    # per rank under tensor parallelism, like every other head count
    plan_tp = analyze_model("mimo_v2_flash", attn_tp_size=4)
    assert [e.num_head for e in plan_tp.cache_entries[SLIDING]] == [2, 2]


def test_gemma2_soft_capping_keeps_legacy_with_the_blocker():
    plan = analyze_model("gemma2")
    assert plan.kv_mode == "legacy"
    assert "soft-capping" in plan.legacy_reason and "50" in plan.legacy_reason
    assert plan.input_layout == "BSH" and plan.sparse_mode == {}
    kv_sources = sources_of(plan, "kv_mode")
    assert kv_sources and kv_sources[0].startswith("modeling_gemma2.py:")


def test_gemma2_without_soft_capping_is_paged():
    plan = analyze_model("gemma2", config_overrides={"attn_logit_softcapping": None})
    assert plan.kv_mode == "paged" and plan.legacy_reason is None
    assert plan.attn_types == [FULL, SLIDING]
    assert plan.window_tokens == {SLIDING: WindowTokens(pre_tokens=4095, next_tokens=0)}
    # gemma2 scales by query_pre_attn_scalar (256), not head_dim
    assert plan.softmax_scale == pytest.approx(256**-0.5)
    assert any("head_dim 256" in w for w in plan.warnings)


def test_layer_types_without_a_window_is_not_sliding():
    # qwen3 with sliding layers declared but sliding_window=None: the code uses no window
    overrides = {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": None,
    }
    plan = analyze_model("qwen3", config_overrides=overrides)
    assert plan.attn_types == [FULL] and plan.window_tokens == {}


def test_composite_model_is_planned_from_its_text_config_language_model():
    # fuyu builds its language model (persimmon) through AutoModel from text_config
    plan = analyze_model("fuyu")
    assert plan.model_type == "persimmon"
    assert plan.source.language_model_of == "fuyu"
    assert plan.source.modeling_file.endswith("modeling_persimmon.py")
    assert plan.code["causal_lm_class"] == "PersimmonForCausalLM"
    assert any(e.decision == "source" and "text_config" in e.reason for e in plan.evidence)


def test_layer_pattern_computed_by_the_config_class_is_used():
    # BambaConfig exposes layer_types as a property over attn_layer_indices (not in to_dict)
    plan = analyze_model(
        "bamba", config_overrides={"num_hidden_layers": 4, "attn_layer_indices": [1]}
    )
    assert plan.layer_attn_types() == [MAMBA, FULL, MAMBA, MAMBA]
    assert "layer_types" not in plan.config


def test_falcon_h1_layers_each_hold_an_attention_kv_and_a_mamba_state():
    # every falcon_h1 layer runs attention and a Mamba-2 mixer side by side
    plan = analyze_model(
        "falcon_h1",
        config_overrides={"num_hidden_layers": 3, "mamba_d_ssm": 96, "mamba_n_heads": 6},
    )
    assert plan.kv_mode == "paged" and plan.implementer_blockers == []
    assert [(layer.index, layer.attn_type.value) for layer in plan.layers] == [
        (i, kind) for i in range(3) for kind in ("FullAttention", "Mamba")
    ]
    assert plan.attn_types == ["FullAttention", "Mamba"]
    assert [layer["index"] for layer in plan.state_cache["layers"]] == [0, 1, 2]
    # the mixer is mamba_d_ssm wide (not the MLP's intermediate_size): conv over x, B and C
    conv, ssm = plan.cache_entries["Mamba"]
    groups, state = plan.config["mamba_n_groups"], plan.config["mamba_d_state"]
    assert conv.dim == [plan.config["mamba_d_conv"] - 1, 96 + 2 * groups * state]
    assert (ssm.num_head, ssm.dim) == (6, [96 // 6, state])
    # the report counts decoder layers, not entries
    from kvskill.analyzer.report import summary_rows

    assert dict(summary_rows(plan))["layers"] == "3: FullAttention x3, Mamba x3"


@pytest.mark.parametrize(("model_type", "mixer"), [("zamba", "mamba1"), ("zamba2", "mamba2")])
def test_zamba_hybrid_layers_hold_an_attention_and_a_mamba_entry(model_type, mixer):
    # the shared attention block's KV (one cache per calling layer), then the layer's own
    # mixer: a multi-head Mamba-1 in zamba, a Mamba-2 in zamba2
    plan = analyze_model(model_type)
    assert not plan.implementer_blockers
    assert {row["mixer"] for row in plan.state_cache["layers"]} == {mixer}
    hybrid = [layer for layer in plan.layers if layer.kind == "hybrid"]
    by_index: dict[int, set[str]] = {}
    for layer in hybrid:
        by_index.setdefault(layer.index, set()).add(layer.attn_type)
    assert by_index and all(kinds == {"FullAttention", "Mamba"} for kinds in by_index.values())


def test_type_that_reuses_another_familys_code_is_resolved_through_its_class():
    # gpt-sw3 has no modeling file of its own; its causal LM class lives in gpt2
    plan = analyze_model("gpt-sw3")
    assert plan.source.modeling_file.endswith("models/gpt2/modeling_gpt2.py")
    assert plan.architecture == "GPT2LMHeadModel"


@pytest.mark.parametrize(
    "model,style,cited",
    [
        ("llama", "half", "modeling_llama.py:"),
        # Complex multiplication of adjacent pairs (view_as_complex) is the interleaved rotation.
        ("deepseek_v2", "interleaved", "view_as_complex"),
        ("deepseek_v3", "interleaved", "rope_interleave"),
        # GPT-J's rotate_every_two and GLM's rotate_half take [..., ::2] / [..., 1::2] pairs
        ("gptj", "interleaved", "rotate_every_two"),
        ("glm", "interleaved", "[..., ::2]"),
        ("gpt2", "none", "config has no rope parameters"),
    ],
)
def test_rope_style_is_read_from_the_rotation_code(model, style, cited):
    plan = analyze_model(model)
    assert plan.rope_style == style
    assert any(cited in source for source in sources_of(plan, "rope_style"))


def test_per_layer_head_counts_other_than_the_model_wide_one_are_a_blocker():
    uniform = analyze_model("laguna", config_overrides={"num_hidden_layers": 2})
    assert not any("per-layer head counts" in b for b in uniform.implementer_blockers)
    mixed = analyze_model(
        "laguna",
        config_overrides={"num_hidden_layers": 2, "num_attention_heads_per_layer": [48, 32]},
    )
    assert any("num_attention_heads_per_layer" in b for b in mixed.implementer_blockers)


@pytest.mark.parametrize(
    ("model", "rotary_dim", "cited"),
    [
        ("gptj", 64, "config rotary_dim=64"),  # 64 of 256
        ("phi", 32, "partial_rotary_factor=0.5"),  # 32 of 64
        ("gpt_neox", 24, "partial_rotary_factor=0.25"),  # 24 of 96
        ("llama", None, None),
    ],
)
def test_partial_rotary_width_is_in_the_plan(model, rotary_dim, cited):
    plan = analyze_model(model)
    assert plan.rotary_dim == rotary_dim
    partial = [e for e in plan.evidence if e.decision == "rope_style" and "partial" in e.reason]
    assert bool(partial) == (cited is not None)
    if cited:
        assert cited in partial[0].source


# -- rotations and position biases in vendor files (snippets of the same shape) ---------------

#: ChatGLM-like: rope tables for half a head, adjacent pairs rotated through [..., 0]/[..., 1]
PAIRS_ROTATION = """
class HalfHeadRotary(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width


def apply_rotary_pos_emb(x, table):
    n = table.shape[-2] * 2
    turned, kept = x[..., :n], x[..., n:]
    pairs = turned.reshape(*turned.shape[:-1], n // 2, 2)
    table = table.view(*table.shape[:-2], n // 2, 2)
    even = pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1]
    odd = pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]
    return torch.cat((torch.stack((even, odd), -1).flatten(-2), kept), dim=-1)


def build_tables(config):
    per_head = config.kv_channels
    return HalfHeadRotary(per_head // 2)
"""

#: DeepSeek-V3-hub-like: de-interleave adjacent pairs with view/transpose, then rotate halves
PERMUTED_ROTATION = """
def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    n, h, t, d = q.shape
    q = q.view(n, h, t, d // 2, 2).transpose(4, 3).reshape(n, h, t, d)
    k = k.view(n, h, t, d // 2, 2).transpose(4, 3).reshape(n, h, t, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
"""

#: Llama-like halves, for contrast
HALF_ROTATION = """
def rotate_half(x):
    a = x[..., : x.shape[-1] // 2]
    b = x[..., x.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
"""

#: Baichuan-13B-like: an ALiBi mask of per-head slopes times key distance
ALIBI_BIAS = """
def _slopes(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]


def _make_alibi_mask(n_head, max_pos):
    slopes = torch.tensor(_slopes(n_head))
    distance = torch.arange(max_pos).unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    return slopes.unsqueeze(1).unsqueeze(1) * distance
"""


def _vendor_model(tmp_path, functions: str, call: str = "", **config) -> str:
    from tests.analyzer.fixtures import REMOTE_MODELING, write_remote_model

    modeling = REMOTE_MODELING.replace(
        "\n\nclass TinyAttention", functions + "\n\nclass TinyAttention"
    )
    seam = "query_states, key_states, value_states = self.project(hidden_states)"
    modeling = modeling.replace(seam, seam + "\n        " + call if call else seam)
    return str(write_remote_model(tmp_path / "vendor", modeling=modeling, **config))


@pytest.mark.parametrize(
    ("functions", "call", "style", "shape"),
    [
        (PAIRS_ROTATION, "query_states = apply_rotary_pos_emb(query_states, table)",
         "interleaved", "[..., 0] / [..., 1]"),
        (PERMUTED_ROTATION, "q, k = apply_rotary_pos_emb(query_states, key_states, c, s)",
         "interleaved", "transpose"),
        (HALF_ROTATION, "q, k = apply_rotary_pos_emb(query_states, key_states, c, s)",
         "half", ""),
    ],
    ids=["chatglm-pairs", "deepseek-hub-permute", "llama-halves"],
)  # fmt: skip
def test_rope_style_of_vendor_rotations(tmp_path, functions, call, style, shape):
    plan = analyze_model(_vendor_model(tmp_path, functions, call, kv_channels=16))
    assert plan.rope_style == style
    cited = sources_of(plan, "rope_style")[0]
    assert cited.startswith("modeling_tiny.py:") and shape in cited


def test_chatglm_like_half_head_rotation_is_partial(tmp_path):
    call = "query_states = apply_rotary_pos_emb(query_states, table)"
    plan = analyze_model(_vendor_model(tmp_path, PAIRS_ROTATION, call, kv_channels=16))
    assert plan.head_dim == 16 and plan.rotary_dim == 8
    # without the half-width tables the pass-through slice alone proves nothing
    whole = PAIRS_ROTATION.replace("HalfHeadRotary(per_head // 2)", "HalfHeadRotary(per_head)")
    plan = analyze_model(_vendor_model(tmp_path / "whole", whole, call, kv_channels=16))
    assert plan.rotary_dim is None


def test_alibi_in_a_vendor_file_is_named_and_legacy(tmp_path):
    plan = analyze_model(_vendor_model(tmp_path, ALIBI_BIAS))
    assert plan.position_bias == "alibi"
    assert plan.kv_mode == "legacy" and plan.input_layout == "BSH"
    assert "ALiBi" in plan.legacy_reason and "_make_alibi_mask" in plan.legacy_reason
    assert "pse_shift" in plan.legacy_reason and plan.sparse_mode == {}
    assert sources_of(plan, "position_bias")[0].startswith("modeling_tiny.py:")


@pytest.mark.parametrize("model", ["bloom", "mpt"])
def test_builtin_alibi_models_are_never_plain_causal_paged(model):
    plan = analyze_model(model)
    assert plan.position_bias == "alibi"
    assert plan.kv_mode == "legacy" and "ALiBi" in plan.legacy_reason
    assert plan.sparse_mode == {} and plan.input_layout == "BSH"


def test_falcon_adds_alibi_only_when_its_config_says_so():
    rotary = analyze_model("falcon")
    assert rotary.position_bias is None and rotary.kv_mode == "paged"
    assert any("config.alibi" in e.reason for e in rotary.evidence if e.decision == "position_bias")
    alibi = analyze_model("falcon", config_overrides={"alibi": True})
    assert alibi.position_bias == "alibi" and alibi.kv_mode == "legacy"
    # falcon's multi_query: one KV head shared by all 71 query heads
    assert (rotary.attention, rotary.num_key_value_heads) == ("mqa", 1)


@pytest.mark.parametrize(
    ("model_type", "mixer_attr"),
    [
        # hybrids whose config's intermediate_size is the MLP's, not the mixer's
        ("jamba", "mamba"),
        ("bamba", "mamba"),
        ("nemotron_h", "mixer"),
        ("zamba", "mamba"),
        ("zamba2", "mamba"),
        # a pure state model, whose intermediate_size is the mixer's
        ("mamba", "mixer"),
    ],
)
def test_the_plans_state_shapes_are_those_of_the_mixer_the_model_builds(model_type, mixer_attr):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    plan = analyze_model(model_type)
    conv, ssm = plan.state_cache["states"]
    config = AutoConfig.for_model(model_type)
    with torch.device("meta"):  # the default sizes, nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    # the mixer's conv runs over its own channels: conv_state is [kernel - 1, channels]
    convs = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Conv1d) and f".{mixer_attr}." in f".{name}"
    ]
    assert convs, "the model builds a conv1d in its mixers"
    conv1d = convs[0]
    assert conv["shape"] == [conv1d.kernel_size[0] - 1, conv1d.in_channels]
    if plan.state_cache["layers"][0]["mixer"] == "mamba1":
        # a Mamba-1 state is [channels, state size]: the conv's channels (x alone)
        assert ssm["shape"][0] == conv1d.in_channels


def test_a_null_layer_pattern_beside_a_state_mixer_is_named_and_a_given_one_converts():
    # lfm2_moe's default config leaves layer_types null: the checkpoint's config states it
    plan = analyze_model("lfm2_moe")
    (blocker,) = plan.implementer_blockers
    assert "layer_types is null" in blocker and "Lfm2MoeShortConv" in blocker
    pattern = ["conv", "conv", "full_attention", "conv"] * 8
    given = analyze_model("lfm2_moe", config_overrides={"layer_types": pattern})
    assert not given.implementer_blockers
    kinds = {layer.index: layer.attn_type for layer in given.layers}
    assert kinds[2] == "FullAttention" and kinds[0] == kinds[1] == kinds[3] == "Mamba"
