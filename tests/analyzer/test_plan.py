"""The typed Plan: closed sets are enums, structured data are records, JSON round-trips."""

from __future__ import annotations

import json

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import (
    AttentionKind,
    CacheEntryPlan,
    DeployMode,
    FaVersion,
    InputLayout,
    KvMode,
    MlaDims,
    Plan,
    PlanSource,
    SourceKind,
    SparseModes,
    WindowTokens,
)
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError


def test_a_gpt_oss_plan_reads_back_typed_from_its_json(tmp_path):
    plan = analyze_model("gpt_oss")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict(), indent=2), encoding="utf-8")

    again = Plan.from_json(path)

    # every closed set is an enum member, every structured value a record
    assert again.attention is AttentionKind.GQA and again.kv_mode is KvMode.PAGED
    assert again.fa_version is FaVersion.V2 and again.input_layout is InputLayout.TND
    assert again.deploy_mode is DeployMode.FRAMEWORK
    assert isinstance(again.source, PlanSource) and again.source.kind is SourceKind.TRANSFORMERS
    assert again.layers[0].attn_type is AttnType.SLIDING_WINDOW
    assert again.attn_types == [AttnType.FULL_ATTENTION, AttnType.SLIDING_WINDOW]
    assert again.sparse_mode["SlidingWindow"] == SparseModes(prefill=4, decode=4)
    assert again.window_tokens["SlidingWindow"] == WindowTokens(pre_tokens=127, next_tokens=0)
    assert isinstance(again.cache_entries["FullAttention"][0], CacheEntryPlan)
    # and it is the same Plan, whose JSON is the same text (the raw config's int keys,
    # e.g. id2label, are JSON strings after the round trip)
    assert again.to_dict() == plan.to_dict()
    assert json.dumps(again.to_dict()) == json.dumps(plan.to_dict())


def test_enums_compare_and_format_as_their_json_strings():
    plan = analyze_model("deepseek_v3")
    assert plan.attention == "mla" and plan.is_mla
    assert isinstance(plan.mla, MlaDims) and plan.mla.qk_rope_head_dim == 64
    # messages and emitted code read the value, never "AttentionKind.MLA"
    assert f"{plan.attention} {plan.input_layout} {plan.layers[0].attn_type}" == (
        "mla TND_NTD FullAttention"
    )
    assert plan.cache_entries[AttnType.FULL_ATTENTION] == plan.cache_entries["FullAttention"]


def test_the_json_text_itself_is_accepted():
    plan = analyze_model("qwen3", config_overrides={"num_hidden_layers": 2})
    assert Plan.from_json(json.dumps(plan.to_dict())).to_dict() == plan.to_dict()


def test_optional_source_keys_stay_absent():
    plan = analyze_model("llava")
    assert plan.source.language_model_of == "llava"
    assert set(plan.to_dict()["source"]) == {
        "kind", "path", "modeling_file", "config_file", "language_model_of",
    }  # fmt: skip
    plain = analyze_model("qwen3").to_dict()["source"]
    assert "language_model_of" not in plain and "vision_language_head" not in plain


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"fa_version": "v3"}, "fa_version is 'v3'; allowed: v1, v2"),
        ({"attention": "dense"}, "attention is 'dense'; allowed: mha, gqa, mqa, mla"),
        ({"kv_mode": "flat"}, "kv_mode is 'flat'; allowed: paged, legacy"),
        ({"deploy_mode": "cloud"}, "deploy_mode is 'cloud'; allowed: framework, standalone"),
    ],
)
def test_a_value_outside_a_closed_set_is_bad_input_naming_the_field(edit, message):
    data = {**analyze_model("qwen3").to_dict(), **edit}
    with pytest.raises(BadInputError) as exc:
        Plan.from_dict(data)
    assert message in str(exc.value)
    assert exc.value.exit_code == 2


def test_unreadable_or_malformed_plans_are_one_line_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        Plan.from_json(tmp_path / "missing.json")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(BadInputError, match="nests deeper than"):
        Plan.from_json(deep)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(BadInputError, match="is not valid JSON"):
        Plan.from_json(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(BadInputError, match="must hold a JSON object"):
        Plan.from_json(listed)
    data = analyze_model("qwen3").to_dict()
    del data["layers"]
    with pytest.raises(BadInputError, match="layers"):
        Plan.from_dict(data)
