"""analyze names every fused-attention limit the model's shapes hit, before apply writes code:
blockers for what the CPU reference refuses too, warnings for what only the NPU refuses."""

from __future__ import annotations

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core import npu_limits
from kvskill.core.errors import UnsupportedModelError


def _limits(plan) -> tuple[list[str], list[str]]:
    blockers = [b for b in plan.implementer_blockers if b.startswith("operator limit")]
    warnings = [w for w in plan.warnings if w.startswith("operator limit") and w not in blockers]
    return blockers, warnings


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen3", "gpt_oss", "mistral", "deepseek_v3", "kimi_linear"]
)
def test_default_configs_hit_no_operator_limit(model_type):
    assert _limits(analyze_model(model_type)) == ([], [])


def test_a_sink_model_whose_value_head_dim_is_not_64_or_128_is_blocked():
    plan = analyze_model("gpt_oss", config_overrides={"head_dim": 96})
    blockers, _ = _limits(plan)
    assert len(blockers) == 1
    assert "learnable sinks need a value head dim in (64, 128), got 96" in blockers[0]
    assert "learnable_sink的参数约束" in blockers[0]  # the doc section is cited
    assert blockers[0] in plan.warnings


def test_a_blocked_plan_is_refused_by_apply(tmp_path):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    with pytest.raises(UnsupportedModelError, match="learnable sinks need a value head dim"):
        apply_model("gpt_oss", tmp_path / "out", ApplyOptions(config_overrides={"head_dim": 96}))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"qk_rope_head_dim": 32}, "MLA rope head dim is 32"),
        ({"kv_lora_rank": 256}, "MLA kv_lora_rank is 256"),
    ],
)
def test_mla_dims_outside_the_fused_path_are_blocked(overrides, expected):
    blockers, _ = _limits(analyze_model("deepseek_v3", config_overrides=overrides))
    assert any(expected in b and "约束" in b for b in blockers), blockers


def test_query_heads_past_256_and_a_wide_paged_cache_are_blocked():
    overrides = {"num_attention_heads": 512, "num_key_value_heads": 512, "head_dim": 128}
    blockers, _ = _limits(analyze_model("llama", config_overrides=overrides))
    assert any("512 query heads per rank exceed 256" in b for b in blockers)
    assert any("KV_N * D = 65536 > 65535" in b for b in blockers)


def test_hardware_only_limits_are_warnings_that_keep_the_conversion():
    # head dim 72 (not 16-aligned) and blocks of 64: the device refuses prompts, the CPU runs
    plan = analyze_model(
        "llama", config_overrides={"head_dim": 72, "num_attention_heads": 4}, block_size=64
    )
    blockers, warnings = _limits(plan)
    assert blockers == []
    assert any("head dim 72 is not a multiple of 16" in w for w in warnings)
    assert any("block_size 64" in w and "multiple of 128 in [128, 512]" in w for w in warnings)
    assert all("kvskill run checks it by default" in w for w in warnings)


def test_mla_shapes_the_npu_refuses_are_warned_per_call():
    # 24 heads: neither the absorbed decode (32/64/128 on v1) nor the TND prefill (8..128 in
    # powers of two) takes them; nope 64 + rope 64 = 128 is not the v1 prefill's 192
    plan = analyze_model(
        "deepseek_v3",
        config_overrides={
            "num_attention_heads": 24,
            "num_key_value_heads": 24,
            "qk_nope_head_dim": 64,
        },
        block_size=16,
    )
    blockers, warnings = _limits(plan)
    assert blockers == []
    text = "\n".join(warnings)
    assert "MLA decode (absorbed, 512-wide latent) with 24 query heads" in text
    assert "MLA prefill (un-absorbed, TND) has Q_D = K_D = 64 + 64 = 128, V_D = 128" in text
    assert "MLA prefill (un-absorbed, TND) with 24 query heads" in text
    assert "block_size 16" in text


def test_the_limits_are_one_set_of_facts_for_analyzer_and_runtime():
    from kvskill.runtime.ops.reference import fa_call
    from kvskill.runtime.ops.reference import npu_limits as runtime_limits

    assert runtime_limits.MAX_HEADS is npu_limits.MAX_HEADS
    assert runtime_limits.TND_V1_DIMS is npu_limits.TND_V1_DIMS
    assert fa_call.MLA_ROPE_DIM == npu_limits.MLA_ROPE_DIM
