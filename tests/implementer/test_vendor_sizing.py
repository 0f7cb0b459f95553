"""Cache sizes from the code, and a shrink that keeps the model's own config rules.

The fixtures ``query_groups_bhsd`` (KV heads from ``config.num_query_groups``, 2 of 8) and
``per_layer_moe_bhsd`` (per-layer ``moe_topk`` / ``moe_intermediate_size`` /
``num_shared_expert`` lists) are in tests/fixtures/vendor/.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer.analyze import analyze_model
from kvskill.analyzer.kv_sizing import ConfigView, kv_sizing
from kvskill.core.config_checks import check_config_values
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model
from kvskill.verify.shrink import shrink_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT, convert_and_verify  # noqa: E402

GROUPS = VENDOR_ROOT / "query_groups_bhsd"
MOE_LISTS = VENDOR_ROOT / "per_layer_moe_bhsd"


def _sizing(source: str, name: str, config: dict, **view) -> object:
    module = cst.parse_module(textwrap.dedent(source))
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
    return kv_sizing(classes[name], classes, ConfigView(config, **view))


def test_the_plan_sizes_the_cache_with_the_kv_heads_the_attention_builds():
    plan = analyze_model(str(GROUPS))
    # the config has no num_key_value_heads: the key list alone would say MHA, 8 heads
    assert plan.num_attention_heads == 8 and plan.num_key_value_heads == 2
    assert plan.attention.value == "gqa"
    for entry in plan.cache_entries["FullAttention"]:
        assert (entry.num_head, entry.dim) == (2, 16)
    # the evidence cites the line that builds k_proj and the key its heads come from
    source = (GROUPS / "modeling_vendor_groups.py").read_text().splitlines()
    cited = [e for e in plan.evidence if e.decision == "num_key_value_heads"]
    assert cited and "config.num_query_groups" in cited[0].reason
    line = int(cited[0].source.rsplit(":", 1)[1])
    assert source[line - 1].strip().startswith("self.k_proj = nn.Linear(")
    assert plan.code["kv_heads"]["config_keys"] == ["num_query_groups"]


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_the_converted_attention_sizes_its_caches_with_the_code_s_own_count(mode, tmp_path):
    apply_model(str(GROUPS), tmp_path / "out", ApplyOptions(deploy_mode=mode))
    text = (tmp_path / "out" / "modeling_vendor_groups.py").read_text()
    assert "max(self.num_key_value_heads // self.attn_tp_size, 1)" in text
    assert "num_attention_heads)" not in text.split("self.num_key_value_heads_per_rank =")[1][:80]


def test_a_cache_sized_otherwise_than_the_projection_is_refused_before_it_runs(tmp_path):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "out"
    apply_model(str(GROUPS), out, ApplyOptions())
    modeling = out / "modeling_vendor_groups.py"
    right = "max(self.num_key_value_heads // self.attn_tp_size, 1)"
    text = modeling.read_text()
    assert right in text
    # what the key-list sizing wrote before: every query head gets a KV head
    modeling.write_text(
        text.replace(right, "max(config.num_attention_heads // self.attn_tp_size, 1)")
    )
    with pytest.raises(UnsupportedModelError, match=r"VendorGroupsAttention .*k_proj writes"):
        verify_directory(out, VerifyOptions(trust_remote_code=True, num_prompts=1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("framework", "paged"), ("standalone", "paged")])
def test_the_query_groups_fixture_verifies_token_exact(mode, tmp_path):
    report = convert_and_verify("query_groups_bhsd", tmp_path / "out", *mode)
    assert report.passed, report.failures()
    # 4 heads over the 2 groups num_query_groups already holds; no key the model never reads
    assert report.config_changes["num_attention_heads"] == [8, 4]
    assert "num_key_value_heads" not in report.config_changes


@pytest.mark.slow
def test_per_layer_moe_lists_convert_and_verify(tmp_path):
    report = convert_and_verify("per_layer_moe_bhsd", tmp_path / "out", "framework", "paged")
    assert report.passed, report.failures()
    assert {"moe_topk", "num_experts", "num_hidden_layers"} <= report.config_changes.keys()


# -- reading the code -------------------------------------------------------------------------


FAMILY = """
class BaseAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.n_head
        self.kv_dim = config.kv_groups * self.head_dim
        self.k_proj = nn.Linear(config.hidden_size, self.kv_dim)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_dim)

class SdpaAttention(BaseAttention):
    pass

class FusedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.n_head
        self.head_dim = config.hidden_size // self.num_heads
        self.wqkv = nn.Linear(config.hidden_size, self.num_heads * self.head_dim + 2 * config.kv_groups * self.head_dim)
"""


def test_sizes_follow_inheritance_attribute_maps_and_config_class_defaults():
    config = {"hidden_size": 256, "n_head": 8}
    # a family variant without __init__ of its own; kv_groups only as the class's default
    sizing = _sizing(FAMILY, "SdpaAttention", config, defaults={"kv_groups": 2})
    assert (sizing.kv_heads, sizing.head_dim) == (2, 32)
    assert sizing.owner == "BaseAttention" and sizing.kv_heads_keys == ("kv_groups",)
    assert sizing.kv_heads_expr == "config.kv_groups"
    # attribute_map: the code reads kv_groups, the config stores it as num_query_groups
    mapped = _sizing(
        FAMILY,
        "BaseAttention",
        {**config, "num_query_groups": 4},
        attribute_map={"kv_groups": "num_query_groups"},
    )
    assert mapped.kv_heads == 4 and mapped.kv_heads_keys == ("num_query_groups",)
    fused = _sizing(FAMILY, "FusedAttention", {**config, "kv_groups": 1})
    assert fused.projections == {"fused": "wqkv"} and fused.kv_heads == 1
    assert fused.kv_heads_expr == "config.kv_groups"


def test_a_projection_not_read_from_the_config_leaves_the_sizes_unknown():
    source = """
    class A(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.k_proj = nn.Linear(config.hidden_size, some_function(config))
            self.v_proj = nn.Linear(config.hidden_size, some_function(config))
    """
    sizing = _sizing(source, "A", {"hidden_size": 64})
    assert sizing.kv_heads is None and sizing.kv_heads_expr == ""


def test_code_heads_that_do_not_divide_the_query_heads_are_bad_input(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(GROUPS, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_query_groups": 3}))
    with pytest.raises(BadInputError, match="3 KV heads, which does not divide the 8"):
        analyze_model(str(model))


# -- shrink -------------------------------------------------------------------------------------


def test_the_shrink_moves_the_key_the_code_sizes_kv_heads_from():
    config = json.loads((GROUPS / "config.json").read_text())
    config.update(num_attention_heads=32, num_query_groups=8, hidden_size=4096)
    code = {"kv_heads": {"config_keys": ["num_query_groups"]}}
    shrunk = shrink_config(config, attribute_map={"num_hidden_layers": "num_layers"}, code=code)
    new = shrunk.config
    # GQA kept: 4 query heads over 2 groups, written where the model reads them
    assert (new["num_attention_heads"], new["num_query_groups"]) == (4, 2)
    assert "num_key_value_heads" not in new
    # without the code's key, only the rule that group counts divide the heads holds it
    # (8 groups over 4 heads would be 0 heads per group): runnable, but no longer GQA
    assert shrink_config(config).config["num_query_groups"] == 4


def test_the_shrink_keeps_per_layer_moe_lists_and_top_k_within_the_experts():
    config = json.loads((MOE_LISTS / "config.json").read_text())
    config.update(num_hidden_layers=6, num_experts=64)
    config.update(moe_topk=[8] * 6, moe_intermediate_size=[1536, 3072] * 3)
    config["num_shared_expert"] = [1, 0] * 3
    new = shrink_config(config).config
    assert new["num_hidden_layers"] == 2
    assert new["moe_topk"] == [8, 8] and new["num_shared_expert"] == [1, 0]
    assert new["moe_intermediate_size"] == [32, 32]
    assert max(new["moe_topk"]) <= new["num_experts"] < 64


def test_the_shrink_keeps_group_counts_dividing_the_heads():
    config = {
        "model_type": "x",
        "num_hidden_layers": 2,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "attention_groups": 8,
    }
    new = shrink_config(config).config
    assert new["num_attention_heads"] == 4 and new["attention_groups"] == 4


# -- config checks ------------------------------------------------------------------------------


def test_per_layer_moe_lists_are_read_and_each_value_is_checked():
    config = json.loads((MOE_LISTS / "config.json").read_text())
    check_config_values(config, where="config.json")  # lists where a scalar is usual
    # the weights are estimated from the mean layer's expert width (--hbm-gb needs them)
    plan = analyze_model(str(MOE_LISTS), hbm_gb=1)
    assert plan.num_layers == 4 and plan.memory["weight_bytes_estimate"] > 0
    bad = {**config, "moe_topk": [8, 8, "eight", 8]}
    with pytest.raises(BadInputError, match=r"moe_topk\[2\] must be an integer, got 'eight'"):
        check_config_values(bad, where="config.json")
    negative = {**config, "moe_intermediate_size": [32, -1, 32, 32]}
    with pytest.raises(BadInputError, match=r"moe_intermediate_size\[1\]=-1 is outside"):
        check_config_values(negative, where="config.json")
