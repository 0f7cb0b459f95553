"""DeepSeek-V4's compressed attention: analyze names its layer kinds, caches, sinks, operators
and sub-features, counts every cache, plans the framework-mode rewrite, and refuses what the
operators or the rewrite cannot serve, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.compressed_attention import WHEEL_HAS, layer_types_of
from kvskill.analyzer.compressed_features import blockers, compressed_features
from kvskill.analyzer.plan import Plan
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.executor_target import check_executor_target
from kvskill.implementer.standalone.convert import convert_standalone
from transformers import DeepseekV4Config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "npu_schemas.json"


@pytest.fixture(scope="module")
def plan():
    return analyze_model("deepseek_v4", kv_memory_bytes=8 << 30)


def test_layer_kinds_ratios_and_caches_come_from_the_config(plan):
    config = DeepseekV4Config()
    csa = [i for i, t in enumerate(config.layer_types) if t == "compressed_sparse_attention"]
    hca = [i for i, t in enumerate(config.layer_types) if t == "heavily_compressed_attention"]
    kinds = {k.name: k for k in plan.compressed_attention.kinds}
    assert sorted(kinds) == ["CSA", "HCA"]
    assert kinds["CSA"].layer_indices == csa and kinds["HCA"].layer_indices == hca
    assert kinds["CSA"].compress_ratio == config.compress_rates["compressed_sparse_attention"]
    assert kinds["HCA"].compress_ratio == config.compress_rates["heavily_compressed_attention"]
    assert kinds["CSA"].indexer == {
        "n_heads": config.index_n_heads,
        "head_dim": config.index_head_dim,
        "topk": config.index_topk,
    }
    # every layer attends its own window of K = V rows: one SlidingWindow entry per layer
    assert {(layer.attn_type, layer.sliding_window) for layer in plan.layers} == {
        ("SlidingWindow", config.sliding_window)
    }
    row = config.head_dim * 2  # bf16, one head, K = V
    index_row = config.index_head_dim * 2
    assert kinds["CSA"].bytes_per_token == row + row // 4 + index_row // 4
    assert kinds["HCA"].bytes_per_token == row + row // 128
    expected = (
        len(config.layer_types) * row + len(csa) * (row + index_row) // 4 + len(hca) * row // 128
    )
    assert plan.kv_bytes_per_token == expected == 50616
    # one pool per group the framework declares: the window, and each ratio's compressed rows
    groups = plan.memory["num_blocks_by_group"]
    assert sorted(groups) == ["c128a_cmp_kv", "c4a_cmp_kv", "win_kv"]
    assert plan.memory["reserved_groups"] == ["win_kv"]
    assert groups["c4a_cmp_kv"] == groups["c128a_cmp_kv"]


def test_sinks_and_the_operators_each_path_needs_are_named(plan):
    compressed = plan.compressed_attention
    assert compressed.sinks == "DeepseekV4Attention.sinks (modeling_deepseek_v4.py:806)"
    kinds = {k.name: k for k in compressed.kinds}
    assert "torch.ops.custom.npu_sparse_attn_sharedkv" in kinds["HCA"].operators_missing
    assert "torch.ops.custom.compressor" in kinds["CSA"].operators_missing
    # the wheel's record: what exists is in the extracted schemas, what does not is absent
    fixture = json.loads(FIXTURE.read_text())
    for name, present in WHEEL_HAS.items():
        bare = name.removeprefix("torch.ops.custom.").split(" ")[0]
        if present:
            assert name in fixture["operators"], name
        elif "(" not in name:
            assert bare in fixture["absent"] and bare not in fixture["operators"], name


def test_framework_mode_converts_and_the_other_targets_refuse(plan):
    # the window, compressor state, CSA indexer and HCA are found as the rewrite reads them
    assert plan.implementer_blockers == []
    assert any(e.decision == "compressed_attention" and "KVR028" in e.reason for e in plan.evidence)
    with pytest.raises(UnsupportedModelError, match="framework mode only"):
        convert_standalone(plan, ApplyOptions(deploy_mode="standalone"))
    with pytest.raises(UnsupportedModelError, match="kvskill's runtime only"):
        check_executor_target(plan, "auto")


def test_a_checkpoint_ratio_list_names_the_same_kinds():
    config = {"compress_ratios": [0, 4, 128, 4]}
    assert layer_types_of(config) == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert layer_types_of({"layer_types": ["full_attention"]}) is None


def _line(source: str, where: str) -> str:
    return source.splitlines()[int(where.rsplit(":", 1)[1]) - 1]


def test_each_sub_feature_is_named_at_the_line_that_holds_it(plan):
    source = Path(plan.source.modeling_file).read_text("utf-8")
    features = {f.name: f for f in plan.compressed_attention.sub_features}
    assert list(features) == ["window", "sinks", "compressor state", "CSA indexer", "HCA"]
    held = {
        "window": "cache.update(kv, kv,",
        "sinks": "self.sinks = ",
        "compressor state": ".store_compression_weights(",
        "CSA indexer": ".topk(",
        "HCA": "class DeepseekV4HCACompressor(",
    }
    for name, text in held.items():
        assert text in _line(source, features[name].where), name
    assert "one cache for K = V" in features["window"].needs
    assert "head_dim is 512" in features["sinks"].needs
    # the wheel's indexer serves CSA with one batch row per query token
    assert "one batch row per query token" in features["CSA indexer"].needs
    assert "cmp_ratio=128" in features["HCA"].needs
    for name in ("window", "compressor state"):
        assert "not in torch_npu 2.13.0" in features[name].needs, name
    # the default config hits no limit; the Plan's JSON keeps the sub-features
    assert not any(f.missing for f in features.values())
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.compressed_attention.sub_features == plan.compressed_attention.sub_features


def test_sub_features_follow_the_file_not_the_model_type(plan):
    """A file whose window keeps separate values and whose indexer does not take a top-k is
    described as it is: no K = V claim, no CSA indexer; a window or a ratio the operators do
    not take is the limit named."""
    source = Path(plan.source.modeling_file).read_text("utf-8")
    assert source.count("index_scores.topk(") == 2
    edited = source.replace("cache.update(kv, kv,", "cache.update(kv, kv * 1.0,").replace(
        "index_scores.topk(", "index_scores.sort("
    )
    features = {
        f.name: f
        for f in compressed_features(
            edited,
            "modeling_x.py",
            "DeepseekV4Attention",
            head_dim=512,
            ratios={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64},
            sinks_line=None,
            window=64,
        )
    }
    assert list(features) == ["window", "compressor state", "HCA"]
    assert "K = V" not in features["window"].needs
    # values the operators do not take, and shapes the rewrite does not read, are named
    assert "separate keys and values" in features["window"].missing
    assert "the config's sliding_window is 64" in features["window"].missing
    assert "heavily_compressed_attention has 64" in features["compressor state"].missing
    assert "compressed_sparse_attention has" not in features["compressor state"].missing
    found = blockers(list(features.values()), ["compressed_sparse_attention"])
    assert "no CSA indexer construct found for the config's layers" in found
    assert any(b.startswith("window (modeling_x.py:836)") for b in found)
