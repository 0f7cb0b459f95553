"""Every reference operator binds its arguments exactly as torch_npu 2.13.0's schema does.

The schemas come from tests/fixtures/npu_schemas.json (scripts/extract_npu_schemas.py), so this
runs offline. A converted model that passes verify on the reference ops must make calls the real
binding accepts: same parameter names, same positional/keyword-only split, same defaults.
"""

from __future__ import annotations

import pytest
from aten_schema import REQUIRED, load_fixture, load_schemas, parse_schema
from kvskill.runtime.ops import reference
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.runtime.ops.reference.refused import REFUSED_OPERATORS
from signature_diff import signature_differences

SCHEMAS = load_schemas()
#: operators of the fixture the reference implements (the rest are mapped targets, see fla.py,
#: or operators it refuses by name, see refused.py)
IMPLEMENTED = sorted(
    name for name in SCHEMAS if hasattr(reference, name) and name not in REFUSED_OPERATORS
)


def test_the_fixture_records_where_each_schema_came_from():
    fixture = load_fixture()
    assert fixture["version"] == "2.13.0"
    assert fixture["wheel"].startswith("torch_npu-2.13.0-")
    for name, op in fixture["operators"].items():
        assert op["yaml_line"] > 0, name
        assert op["func"].startswith(f"{name}("), name


def test_at_least_twelve_reference_operators_are_held_to_a_schema():
    assert len(IMPLEMENTED) >= 12, IMPLEMENTED


def test_every_public_reference_operator_has_a_schema():
    public = [n for n in reference.__all__ if not n[0].isupper()]
    assert sorted(set(public) - set(SCHEMAS)) == []


def test_the_framework_models_operators_are_all_held_to_a_schema():
    # the unquantized bf16/fp32 paths of cann-recipes-infer's qwen3_5, pangu_7b and module/
    framework = {
        "npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul",
        "npu_apply_rotary_pos_emb", "npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2",
        "npu_moe_finalize_routing", "npu_moe_re_routing", "npu_grouped_matmul",
        "npu_recurrent_gated_delta_rule", "npu_chunk_gated_delta_rule",
        "npu_fused_infer_attention_score", "scatter_update_", "npu_scatter_nd_update_",
        "npu_interleave_rope", "npu_format_cast",
    }  # fmt: skip
    assert sorted(framework - set(IMPLEMENTED)) == []


def test_the_dsa_operators_are_held_to_a_schema_and_served_by_the_standin():
    # deepseek_v3_2_exp, glm_5 and glm_5_2 call these two on their unquantized path
    dsa = ("npu_lightning_indexer", "npu_sparse_flash_attention")
    assert [name for name in dsa if name in IMPLEMENTED] == list(dsa)
    with npu_standin() as torch_npu:
        for name in dsa:
            assert getattr(torch_npu, name) is getattr(reference, name)


def test_every_operator_the_standin_defines_is_a_schema_checked_reference_operator():
    public = [n for n in reference.__all__ if not n[0].isupper()]
    with npu_standin() as torch_npu:
        import torch

        for name in public:
            assert getattr(torch_npu, name) is getattr(reference, name), name
            assert getattr(torch.ops.npu, name) is getattr(reference, name), name
    assert sorted(set(public) ^ set(IMPLEMENTED)) == []


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_reference_signature_matches_the_torch_npu_schema(name):
    assert signature_differences(getattr(reference, name), SCHEMAS[name]) == []


def test_the_parser_reads_kinds_defaults_and_renames_self():
    schema = parse_schema(
        "op_(Tensor(a!) self, int axis, *, Tensor? w=None, float eps=1e-5, str mode='Norm', "
        'str layout="BSH", int[] ids=[], int big=2147483647, bool flag=False) -> Tensor(a!)'
    )
    assert schema.names == ("input", "axis", "w", "eps", "mode", "layout", "ids", "big", "flag")
    assert [p.keyword_only for p in schema.params] == [False, False] + [True] * 7
    assert [p.default for p in schema.params][1:] == [
        REQUIRED,
        None,
        1e-5,
        "Norm",
        "BSH",
        [],
        2147483647,
        False,
    ]
    assert schema.param("input").base_type == "Tensor"


def test_the_comparison_reports_each_kind_of_difference():
    schema = parse_schema(
        "f(Tensor self, int acl_format, *, int? customize_dtype=None, bool flag=False) -> Tensor"
    )

    def wrong(data, acl_format, customize_dtype=None, flag=0, extra=1):
        return data

    diffs = signature_differences(wrong, schema)
    assert any("missing parameter `input`" in d for d in diffs)
    assert any("`customize_dtype` is positional or keyword" in d for d in diffs)
    assert any("`flag` defaults to 0" in d for d in diffs)
    assert any("extra parameter `data`" in d for d in diffs)
    assert any("extra parameter `extra`" in d for d in diffs)
